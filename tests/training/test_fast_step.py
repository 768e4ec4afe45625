"""The step that never waits for the device: the loss read once per log interval (a non-finite one
still stops the run at its step), the next batch prepared during the step (exact resume kept),
the masked-LM loss through the model's forward (so compilation reaches it), the compile setting
and its eager fallback, and one printing process under torchrun."""

import json

import pytest
import torch

from conftest import require_data
from mhe.cli import main
from mhe.errors import MheError
from mhe.tasks.mlm import MaskedLMTask, masked_positions, masked_rows
from mhe.tasks.recall import RecallTask
from mhe.training import checkpoint as ckpt
from mhe.training import step as step_module
from mhe.training.config import apply_overrides, compile_wanted
from mhe.tasks import default_run
from mhe.training.loop import Trainer, TrainingStopped
from mhe.training.run_files import read_metrics

SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=4",
         'data.task_options={"train_size": 64, "test_size": 16, "pairs": 3, "queries": 3}',
         "train.batch_size=8", "train.steps=10", "train.log_every=5", "train.save_every=4", "train.progress=false",
         "train.warmup_steps=1"]
MLM = ["data.limit_lines=200", "data.vocab_size=300", "model.max_len=32", "model.d_model=32", "model.d_ff=64",
       "model.n_layers=1", "train.batch_size=4", "train.steps=6", "train.log_every=1", "train.save_every=3",
       "train.progress=false", "train.warmup_steps=1"]


def recall_run(*extra):
    return apply_overrides(default_run("recall", "tiny-decoder", "mha"), SMALL + list(extra))


def mlm_run(*extra):
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz")
    cfg = apply_overrides(default_run("mlm", "tiny-encoder", "mhe-mul", "ptb"), MLM + list(extra))
    cfg.data.data_dir = str(root)
    return cfg


def quiet(*_):
    pass


class BadAt(RecallTask):
    """Recall whose loss (``what="loss"``) or gradient (``"grad"``) turns NaN at optimiser step ``at``."""

    def __init__(self, at, what="loss"):
        self.at, self.what, self.calls = at, what, 0

    def loss(self, model, batch, **kw):
        loss, n = super().loss(model, batch, **kw)
        self.calls += 1
        if self.calls == self.at:
            if self.what == "loss":
                loss = loss * float("nan")
            else:
                loss.register_hook(lambda g: g * float("nan"))
        return loss, n


@pytest.mark.parametrize("what, name", [("loss", "loss"), ("grad", "gradient norm")])
def test_a_nan_between_log_boundaries_stops_at_its_step_and_nothing_after_it_is_saved(tmp_path, what, name):
    """Logged every 5 steps, saved every 4: a NaN at step 6 is found when step 8 would be saved;
    the error names step 6 and checkpoint 4, and no checkpoint of step 8 is written."""
    with pytest.raises(TrainingStopped, match=rf"non-finite {name} \(nan\) at step 6; stopped; "
                                              r"last good checkpoint: .*step-00000004$"):
        Trainer(recall_run(), BadAt(6, what), tmp_path, log=quiet).fit()
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-00000004"]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [5]


def test_a_nan_stops_the_cli_with_exit_2_and_one_line(tmp_path, capsys, monkeypatch):
    calls = []

    def loss(self, model, batch, **kw):
        out, n = RecallTask_loss(self, model, batch, **kw)
        calls.append(1)
        return (out * float("nan") if len(calls) == 3 else out), n

    RecallTask_loss = RecallTask.loss
    monkeypatch.setattr(RecallTask, "loss", loss)
    args = ["train", "--task", "recall", "--preset", "tiny-decoder", "--out", str(tmp_path / "run")]
    assert main(args + [a for s in SMALL + ["train.save_every=0"] for a in ("--set", s)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "non-finite loss (nan) at step 3" in err and "Traceback" not in err


class Recording(RecallTask):
    """Records each batch drawn and a number from the global generator (as a masking collator would)."""

    log: list = []

    def collate(self, indices):
        Recording.log.append((tuple(indices), torch.rand(()).item()))
        return super().collate(indices)


def test_prefetching_changes_nothing_and_resumes_exactly(tmp_path):
    """The next batch prepared during the step (forced on for a CPU): the same batches, draws and
    losses as collating each batch when it is taken, also across a stop and resume whose
    checkpoint was saved while a batch was prepared (the rewound batch is drawn again alike)."""
    def once(log):  # a batch prepared, rewound before a checkpoint and drawn again appears twice in a row
        return [d for i, d in enumerate(log) if i == 0 or d != log[i - 1]]

    runs = {}
    for name, prefetch in (("plain", False), ("ahead", True)):
        Recording.log = []
        Trainer(recall_run("train.log_every=1"), Recording(), tmp_path / name, log=quiet, prefetch=prefetch).fit()
        runs[name] = (list(Recording.log), [r["loss"] for r in read_metrics(tmp_path / name / "metrics.jsonl")])
    plain, ahead = runs["plain"][0], runs["ahead"][0]
    assert len(plain) == 10 and len(ahead) > len(once(ahead))  # saves at 4 and 8 rewound a prepared batch
    assert once(ahead)[:10] == plain and len(once(ahead)) == 11  # + the batch prepared after the last step
    assert runs["ahead"][1] == runs["plain"][1]
    Recording.log = []
    Trainer(recall_run("train.log_every=1", "train.stop_at=6"), Recording(), tmp_path / "r", log=quiet,
            prefetch=True).fit()
    Trainer(recall_run("train.log_every=1"), Recording(), tmp_path / "r", resume=True, log=quiet, prefetch=True).fit()
    assert once(Recording.log)[:10] == plain
    assert [r["loss"] for r in read_metrics(tmp_path / "r" / "metrics.jsonl")] == runs["plain"][1]


@pytest.fixture(scope="module")
def mlm_setup(tmp_path_factory):
    """An MLM task set up as a compiled run would be (fixed masked-row count) and one batch."""
    task = MaskedLMTask()
    model = task.setup(mlm_run("train.compile=true"), tmp_path_factory.mktemp("mlm"), step_module.Dist())
    model.train(False)  # no dropout: two passes must compute the same function
    return task, model, task.collate(list(range(4)))


class Counting(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, *a, **kw):
        self.calls += 1
        return self.inner(*a, **kw)


def test_the_masked_lm_loss_runs_through_the_forward_on_the_masked_rows(mlm_setup):
    """The task's loss calls the model itself (so torch.compile and DDP see the head), on the
    masked rows padded to a fixed count, and equals the loss of the full head."""
    task, model, batch = mlm_setup
    assert task.static
    pos = batch["masked_positions"]
    assert pos.numel() == masked_rows(4 * 30) and pos.numel() > batch["n_tokens"] == int((batch["labels"] != -100).sum())
    wrapped = Counting(model)
    loss, n = task.loss(wrapped, batch)
    assert wrapped.calls == 1 and n == batch["n_tokens"]
    torch.testing.assert_close(loss, model(batch["input_ids"], labels=batch["labels"]).loss, rtol=1e-6, atol=0)


@pytest.mark.slow
def test_the_compiled_masked_lm_loss_equals_the_eager_one(mlm_setup):
    task, model, batch = mlm_setup
    eager, _ = task.loss(model, batch)
    compiled, _ = task.loss(torch.compile(model, backend="aot_eager", fullgraph=True), batch)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=0)
    g_eager = torch.autograd.grad(eager, list(model.parameters()))
    g_comp = torch.autograd.grad(compiled, list(model.parameters()))
    for a, b in zip(g_eager, g_comp):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


def test_masked_positions_pad_with_an_unlabelled_position():
    labels = torch.full((2, 5), -100)
    labels[0, 2], labels[1, 4] = 7, 8
    assert masked_positions(labels).tolist() == [2, 9]
    assert masked_positions(labels, 4).tolist() == [2, 9, 0, 0]
    assert masked_positions(labels, 1).numel() == 64  # more than planned: the next multiple of 64
    assert masked_rows(16352) == 2752  # bert-base batch 32 x 512: mean 2453 + six sd 274 = 2727, rounded up


def test_mlm_training_is_unchanged_by_the_forward_route(tmp_path):
    """A CPU run trains through the new route exactly as before: the same loss at every step
    as computing each step with masked_lm_loss (the earlier route)."""
    class Earlier(MaskedLMTask):
        def loss(self, model, batch, **kw):
            return model.masked_lm_loss(batch["input_ids"], batch["labels"]).loss, batch["n_tokens"]

    Trainer(mlm_run(), MaskedLMTask(), tmp_path / "new", log=quiet).fit()
    Trainer(mlm_run(), Earlier(), tmp_path / "old", log=quiet).fit()
    new, old = (read_metrics(tmp_path / d / "metrics.jsonl") for d in ("new", "old"))
    assert [r["loss"] for r in new] == [r["loss"] for r in old] and len(new) == 6


def test_compile_setting_and_the_eager_fallback(tmp_path, monkeypatch):
    """train.compile: auto (on CUDA only), true, false; saved booleans load. A configuration the
    compiler fails on trains eagerly, with one note, and trains as eager does."""
    cfg = recall_run()
    assert cfg.train.compile == "auto" and not compile_wanted(cfg.train, torch.device("cpu"))
    assert compile_wanted(cfg.train, torch.device("cuda"))
    assert recall_run("train.compile=TRUE").train.compile is True
    assert not compile_wanted(recall_run("train.compile=false").train, torch.device("cuda"))
    with pytest.raises(MheError, match="train.compile='maybe' is not allowed; train.compile takes true or false "
                                       "or one of auto"):
        recall_run("train.compile=maybe")

    class Broken(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *a, **kw):
            raise RuntimeError("no working C compiler\nsecond line")

    monkeypatch.setattr(step_module.torch, "compile", lambda m, **kw: Broken(m))
    notes = []
    Trainer(recall_run("train.compile=true", "train.log_every=1"), RecallTask(), tmp_path / "c", log=notes.append).fit()
    Trainer(recall_run("train.log_every=1"), RecallTask(), tmp_path / "e", log=quiet).fit()
    assert notes == ["torch.compile cannot compile this configuration (RuntimeError: no working C compiler); "
                     "training eagerly"]
    compiled, eager = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ce")
    assert [r["loss"] for r in compiled] == [r["loss"] for r in eager]


def test_a_backward_pass_the_compiler_cuts_short_leaves_no_partial_gradient(tmp_path, monkeypatch):
    """The compiled module fails in the backward pass after the blocks' gradients exist (at the
    embedding): the eager retry starts from no gradients, so the run trains as eager does."""

    class FailsLate(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, *a, **kw):
            def cut(module, args, out):
                out.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("inductor failed in backward")))

            handle = self.inner.decoder.embed.register_forward_hook(cut)
            try:
                return self.inner(*a, **kw)
            finally:
                handle.remove()

    monkeypatch.setattr(step_module.torch, "compile", lambda m, **kw: FailsLate(m))
    notes = []
    Trainer(recall_run("train.compile=true", "train.log_every=1"), RecallTask(), tmp_path / "c", log=notes.append).fit()
    Trainer(recall_run("train.log_every=1"), RecallTask(), tmp_path / "e", log=quiet).fit()
    assert notes == ["torch.compile cannot compile this configuration (RuntimeError: inductor failed in backward); "
                     "training eagerly"]
    compiled, eager = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ce")
    assert [(r["loss"], r["grad_norm"]) for r in compiled] == [(r["loss"], r["grad_norm"]) for r in eager]


def test_only_rank_0_prints_under_torchrun(tmp_path, capsys, monkeypatch):
    args = ["params", "--preset", "bert-base"]
    assert main(args) == 0
    assert "bert-base" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    assert main(args) == 0
    assert capsys.readouterr().out == ""
    assert main(["params", "--preset", "no-such-preset"]) == 2  # every rank exits 2; rank 0 alone says why
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main(["params", "--preset", "no-such-preset"]) == 2
    assert "no-such-preset" in capsys.readouterr().err


def test_the_log_records_the_step_loss_and_no_more(tmp_path):
    """Read once per interval, the record still holds that step's loss and gradient norm (as a
    run logged every step shows)."""
    Trainer(recall_run("train.log_every=1"), RecallTask(), tmp_path / "a", log=quiet).fit()
    Trainer(recall_run(), RecallTask(), tmp_path / "b", log=quiet).fit()
    every = {r["step"]: r for r in read_metrics(tmp_path / "a" / "metrics.jsonl")}
    for r in read_metrics(tmp_path / "b" / "metrics.jsonl"):
        assert r["loss"] == every[r["step"]]["loss"] and r["grad_norm"] == every[r["step"]]["grad_norm"]
    assert [r["step"] for r in read_metrics(tmp_path / "b" / "metrics.jsonl")] == [5, 10]
    assert json.loads((tmp_path / "b" / "results.json").read_text())["status"] == "finished"
