"""The trainer's state and bookkeeping: state round trip, best weights, early stopping,
gradient accumulation, precision, compile, label smoothing, epochs, the random stream
across a resume, exit codes, the metrics log, temporary folders, the strict weight
loader and malformed run files."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mhe.cli import main
from mhe.errors import MheError
from mhe.tasks.recall import RecallTask
from mhe.training import checkpoint as ckpt
from mhe.training.atomic import verify
from mhe.training.batches import BatchOrder
from mhe.training.config import apply_overrides
from mhe.tasks import default_run
from mhe.training.loop import Trainer
from mhe.training.optim import build_optimizer
from mhe.tasks import read_run_config, read_run_config_file
from mhe.training.run_files import read_metrics
from mhe.training.state import TrainerState
from mhe.training.weights import load_best, load_state_strict, load_weights

SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.n_heads=4", "model.dropout=0.1",
         "model.attn_dropout=0.1", 'data.task_options={"train_size": 64, "test_size": 16, "pairs": 3, "queries": 3}',
         "train.batch_size=8", "train.steps=6", "train.log_every=1", "train.save_every=3", "train.progress=false",
         "train.warmup_steps=1"]
NO_DROPOUT = ["model.dropout=0", "model.attn_dropout=0"]


def tiny_run(*extra):
    return apply_overrides(default_run("recall", "tiny-decoder", "mha"), SMALL + list(extra))


def quiet(*_):
    pass


def steps_logged(out: Path) -> list[int]:
    return [r["step"] for r in read_metrics(out / "metrics.jsonl")]


def weights_of(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class ScriptedTask(RecallTask):
    """Recall whose evaluations return scripted scores and record the weights they saw."""

    def __init__(self, scores):
        self.scores, self.seen, self.final_weights = list(scores), [], None

    def evaluate(self, model):
        self.seen.append(weights_of(model))
        return {"accuracy": self.scores[len(self.seen) - 1]}

    def final(self, model):
        self.final_weights = weights_of(model)
        return {"score": 0.0}


# ---------------------------------------------------------------- the state object
def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_torn_checkpoint(tmp_path, monkeypatch):
    """Pruning past keep_last deletes file by file; killed half way (found by benchmarks/kill_trials.py
    under DDP), the old folder must not stay behind under its step-N name without its manifest."""
    model = torch.nn.Linear(3, 2)
    opt, sched = build_optimizer(model, tiny_run().train)
    state = TrainerState(opt, sched, BatchOrder(64, 8, seed=1), config_hash="abc")
    for step in (1, 2):
        state.step = step
        ckpt.save_checkpoint(tmp_path, model=model, state=state.state_dict(), keep_last=2)

    def killed_half_way(path, ignore_errors=False):  # the manifest goes first, then the process dies
        (Path(path) / "manifest.json").unlink()
        raise KeyboardInterrupt
    import mhe.training.atomic as atomic
    monkeypatch.setattr(atomic.shutil, "rmtree", killed_half_way)
    state.step = 3
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_checkpoint(tmp_path, model=model, state=state.state_dict(), keep_last=2)
    monkeypatch.undo()
    names = [p.name for p in ckpt.list_checkpoints(tmp_path)]
    assert names == ["step-00000002", "step-00000003"]
    assert all(verify(p) is None for p in ckpt.list_checkpoints(tmp_path))
    from mhe.training.atomic import remove_temporaries
    assert [p.name.startswith(".tmp-removed-step-00000001") for p in remove_temporaries(tmp_path)] == [True]


def test_trainer_state_round_trips_through_a_checkpoint(tmp_path):
    model = torch.nn.Linear(3, 2)
    cfg = tiny_run().train
    opt, sched = build_optimizer(model, cfg)
    state = TrainerState(opt, sched, BatchOrder(64, 8, seed=1), config_hash="abc")
    for _ in range(3):
        state.data.next()
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        sched.step()
        state.step += 1
    state.improved(0.5, True)
    state.improved(0.4, True)
    path = ckpt.save_checkpoint(tmp_path, model=model, state=state.state_dict(), keep_last=1)
    expected_draw = torch.rand(5)  # what the generator gives right after the save
    expected_batch = state.data.next()

    model2 = torch.nn.Linear(3, 2)
    opt2, sched2 = build_optimizer(model2, cfg)
    again = TrainerState(opt2, sched2, BatchOrder(64, 8, seed=1))
    torch.manual_seed(123)  # a different stream until the state is loaded
    again.load_state_dict(ckpt.load_checkpoint(path, model=model2))
    assert (again.step, again.best, again.best_step, again.bad_evals, again.config_hash) == (3, 0.5, 3, 1, "abc")
    assert torch.equal(torch.rand(5), expected_draw)
    assert again.data.next() == expected_batch
    assert sched2.get_last_lr() == sched.get_last_lr() and sched2.last_epoch == 3
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])
        assert torch.equal(opt.state[p]["exp_avg_sq"], opt2.state[q]["exp_avg_sq"])


def test_this_runs_kernel_flags_place_the_loaded_step_counts(tmp_path, monkeypatch):
    """torch puts a loaded AdamW step count on the parameter's device only when the param group it
    reads says fused or capturable; it reads the groups handed to it, so this run's flags must be
    in them (a CPU run's checkpoint resumed by fused AdamW on a GPU kept its step counts on the
    host). The groups torch reads at the load carry the loading optimiser's flags."""
    model = torch.nn.Linear(3, 2)
    opt, sched = build_optimizer(model, tiny_run().train)
    state = TrainerState(opt, sched, BatchOrder(64, 8, seed=1))
    model(torch.randn(4, 3)).pow(2).sum().backward()
    opt.step()
    sched.step()
    state.step = 1
    saved = state.state_dict()
    assert {g.get("capturable") for g in saved["optimizer"]["param_groups"]} == {False}
    opt2, sched2 = build_optimizer(model, tiny_run().train)
    for group in opt2.param_groups:  # as a GPU run's optimiser would be built
        group["capturable"] = True
    seen, policy = [], torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(param, value, param_id, param_groups, key=None):
        if key == "step":
            seen.append({g.get("capturable") for g in param_groups})
        return policy(param, value, param_id, param_groups, key)
    monkeypatch.setattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(spy))
    TrainerState(opt2, sched2, BatchOrder(64, 8, seed=1)).load_state_dict(saved)
    assert seen and all(flags == {True} for flags in seen)
    assert all(g["capturable"] for g in opt2.param_groups)


class RecordingTask(RecallTask):
    """Records, per step, the batch drawn and a number from the global generator (as dropout would)."""

    log: list = []

    def collate(self, indices):
        RecordingTask.log.append((tuple(indices), torch.rand(()).item()))
        return super().collate(indices)


def test_a_resume_continues_the_same_random_stream(tmp_path):
    RecordingTask.log = []
    Trainer(tiny_run(), RecordingTask(), tmp_path / "a", log=quiet).fit()
    straight = list(RecordingTask.log)
    RecordingTask.log = []
    Trainer(tiny_run("train.stop_at=3"), RecordingTask(), tmp_path / "b", log=quiet).fit()
    Trainer(tiny_run(), RecordingTask(), tmp_path / "b", resume=True, log=quiet).fit()
    assert len(straight) == 6 and RecordingTask.log == straight
    assert straight[3] != straight[0]  # a resume that re-seeded would repeat step 1's draw at step 4


# ---------------------------------------------------------------- best weights, early stopping
def test_best_weights_reload_equals_the_best_steps_weights(tmp_path):
    task = ScriptedTask([0.1, 0.9, 0.3])  # evaluations at steps 2, 4, 6: the best is step 4
    res = Trainer(tiny_run("train.eval_every=2"), task, tmp_path, log=quiet).fit()
    assert res["status"] == "finished" and len(task.seen) == 3
    assert json.loads((tmp_path / "best" / "best.json").read_text()) == {"step": 4, "score": 0.9}
    assert verify(tmp_path / "best") is None  # sealed like a checkpoint
    best, last = task.seen[1], task.seen[2]
    assert any(not torch.equal(best[k], last[k]) for k in best)
    for k in best:
        assert torch.equal(task.final_weights[k], best[k]), k


@pytest.mark.parametrize("scores, patience, stop", [
    ([0.5, 0.6, 0.55, 0.58, 0.9, 0.9], 2, 4),   # two evaluations without improvement after step 2
    ([0.5, 0.4, 0.6, 0.5, 0.5, 0.9], 2, 5),     # an improvement at step 3 resets the count
    ([0.5, 0.4, 0.6, 0.5, 0.5, 0.9], 0, 6),     # patience 0: never stops early
])
def test_early_stopping_stops_at_the_right_evaluation(tmp_path, scores, patience, stop):
    task = ScriptedTask(scores)
    res = Trainer(tiny_run("train.eval_every=1", f"train.patience={patience}"), task, tmp_path, log=quiet).fit()
    assert res["status"] == ("early_stopped" if stop < 6 else "finished")
    assert res["steps"] == stop and steps_logged(tmp_path)[-1] == stop and len(task.seen) == stop


# ---------------------------------------------------------------- what a step computes
class WeightsAtEnd(RecallTask):
    def final(self, model):
        self.final_weights = weights_of(model)
        return {"score": 0.0}


def test_gradient_accumulation_matches_the_whole_batch(tmp_path):
    """Batch 4 in one go == 2 micro-batches of 2 (every recall item scores the same number of tokens)."""
    whole, split = WeightsAtEnd(), WeightsAtEnd()
    # No attention biases: the key bias's true gradient is zero (softmax ignores a per-query constant), so
    # its computed gradient is rounding noise, which Adam's normalised update turns into +-lr either way.
    flat = (*NO_DROPOUT, "model.attn_bias=false")
    Trainer(tiny_run(*flat, "train.batch_size=4", "train.steps=3"), whole, tmp_path / "a", log=quiet).fit()
    Trainer(tiny_run(*flat, "train.batch_size=2", "train.grad_accum=2", "train.steps=3"), split,
            tmp_path / "b", log=quiet).fit()
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    for ra, rb in zip(a, b, strict=True):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-5)  # not doubled, not halved
    for k, v in whole.final_weights.items():
        torch.testing.assert_close(split.final_weights[k], v, rtol=0, atol=1e-6)


def test_bf16_autocast_runs_on_cpu_close_to_fp32(tmp_path):
    Trainer(tiny_run(*NO_DROPOUT, "train.steps=2", "train.precision=fp32"), RecallTask(), tmp_path / "a",
            log=quiet).fit()
    Trainer(tiny_run(*NO_DROPOUT, "train.steps=2", "train.precision=bf16"), RecallTask(), tmp_path / "b",
            log=quiet).fit()
    fp32, bf16 = (read_metrics(tmp_path / d / "metrics.jsonl")[0]["loss"] for d in "ab")
    assert bf16 != fp32  # autocast really ran in bf16
    assert bf16 == pytest.approx(fp32, rel=2e-2)


@pytest.mark.slow
def test_compile_trains_like_eager(tmp_path):
    Trainer(tiny_run(*NO_DROPOUT, "train.steps=2"), RecallTask(), tmp_path / "a", log=quiet).fit()
    Trainer(tiny_run(*NO_DROPOUT, "train.steps=2", "train.compile=true"), RecallTask(), tmp_path / "b",
            log=quiet).fit()
    eager, compiled = (read_metrics(tmp_path / d / "metrics.jsonl") for d in "ab")
    for e, c in zip(eager, compiled, strict=True):
        assert c["loss"] == pytest.approx(e["loss"], rel=1e-4)


def test_label_smoothing_follows_its_formula():
    """loss = (1 - eps) * NLL(target) + eps * mean over the vocabulary of -log p (Szegedy et al. 2016)."""
    from mhe.models import build_model

    model = build_model("tiny-encoder-decoder", attention="mha", vocab_size=99, d_model=32, d_ff=64, n_layers=1,
                        dropout=0.0, attn_dropout=0.0).eval()
    src, tgt = torch.randint(1, 99, (2, 7)), torch.randint(1, 99, (2, 7))
    labels = torch.randint(1, 99, (2, 7))
    labels[0, -2:] = -100
    eps = 0.1
    out = model(src, tgt, labels=labels, label_smoothing=eps)
    logp = torch.log_softmax(out.logits.double(), -1)[labels != -100]  # [N, V]
    target = labels[labels != -100]
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    expected = ((1 - eps) * nll - eps * logp.mean(-1)).mean()
    assert out.loss.item() == pytest.approx(expected.item(), rel=1e-6)
    plain = model(src, tgt, labels=labels).loss
    assert plain.item() == pytest.approx(nll.mean().item(), rel=1e-6) and plain.item() != out.loss.item()


def test_epochs_set_the_steps_and_the_evaluation_cadence(tmp_path):
    Trainer(tiny_run("train.epochs=1.5", "train.stop_at=1"), RecallTask(), tmp_path, log=quiet).fit()
    resolved = json.loads((tmp_path / "config.json").read_text())["resolved_train"]
    assert resolved["steps"] == 12 and resolved["eval_every"] == 8  # 64 items // batch 8 = 8 per epoch


# ---------------------------------------------------------------- bookkeeping
def test_metrics_are_cut_back_to_the_resumed_checkpoint(tmp_path):
    Trainer(tiny_run("train.stop_at=4", "train.save_every=3"), RecallTask(), tmp_path, log=quiet).fit()
    # step 4 was saved as the stop; now pretend steps 5-6 were logged and then the process was killed
    # before checkpointing them, and that the step-4 checkpoint never made it
    ckpt.list_checkpoints(tmp_path / "checkpoints")[-1].joinpath("manifest.json").unlink()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 1.0}) + "\n" + json.dumps({"step": 6, "loss": 1.0}) + '\n{"step": 7,')
    messages = []
    Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=messages.append).fit()
    assert any("resuming from" in m and "step-00000003" in m for m in messages)
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_metrics_are_cut_to_nothing_when_no_checkpoint_was_saved(tmp_path):
    Trainer(tiny_run("train.stop_at=2", "train.save_every=0"), RecallTask(), tmp_path, log=quiet).fit()
    for p in ckpt.list_checkpoints(tmp_path / "checkpoints"):
        (p / "manifest.json").unlink()
    Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=quiet).fit()
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_garbage_in_the_metrics_log_is_named_on_resume(tmp_path):
    Trainer(tiny_run("train.stop_at=3"), RecallTask(), tmp_path, log=quiet).fit()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("not json\n" + json.dumps({"step": 9}) + "\n")
    with pytest.raises(MheError, match=r"metrics.jsonl line 4: not a metrics record"):
        Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=quiet).fit()


def test_leftover_temporary_folders_are_removed_on_start(tmp_path):
    Trainer(tiny_run("train.stop_at=3"), RecallTask(), tmp_path, log=quiet).fit()
    junk = [tmp_path / "checkpoints" / ".tmp-step-00000006-99999", tmp_path / ".tmp-best-99999"]
    for d in junk:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half a file")
    (tmp_path / ".config.json.tmp99999").write_text("{")
    messages = []
    Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=messages.append).fit()
    assert not any(p.exists() for p in junk) and not (tmp_path / ".config.json.tmp99999").exists()
    assert sum("left by an interrupted write" in m for m in messages) == 3


TRAIN = ["train", "--task", "recall", "--preset", "tiny-decoder"] + [a for s in SMALL for a in ("--set", s)]


def test_resume_of_a_finished_run_does_nothing_and_exits_0(tmp_path, capsys):
    assert main(TRAIN + ["--out", str(tmp_path)]) == 0
    stamp = (tmp_path / "results.json").stat().st_mtime_ns
    n_logged = len(steps_logged(tmp_path))
    capsys.readouterr()
    assert main(TRAIN + ["--out", str(tmp_path), "--resume"]) == 0
    assert "already finished" in capsys.readouterr().err
    assert (tmp_path / "results.json").stat().st_mtime_ns == stamp and len(steps_logged(tmp_path)) == n_logged


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_resume_where_there_is_no_run_exits_2(tmp_path, capsys, make):
    out = tmp_path / "run"
    if make == "empty":
        out.mkdir()
    assert main(TRAIN + ["--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"there is no run in {out}" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())  # nothing written


def _interrupt(tmp_path, sig) -> tuple[int, str]:
    """Start a long `mhe train`, send ``sig`` once it has logged a step, return (exit code, stderr)."""
    out = tmp_path / f"run-{sig}"
    cmd = [sys.executable, "-m", "mhe", *TRAIN, "--out", str(out), "--set", "train.steps=100000",
           "--set", "train.save_every=0"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[2] / "src"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out / "metrics.jsonl").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert ckpt.latest_checkpoint(out / "checkpoints") is not None  # saved before exiting
    return proc.returncode, err


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_saved_run_exits_128_plus_the_signal(tmp_path, sig, code):
    rc, err = _interrupt(tmp_path, sig)
    assert rc == code and "continue with --resume" in err


# ---------------------------------------------------------------- the strict loader
def test_strict_loader_refuses_missing_unexpected_and_reshaped_weights():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    good = weights_of(model)
    with pytest.raises(MheError, match=r"lacks 1 weight\(s\) the model needs: 1.bias$"):
        load_state_strict(model, {k: v for k, v in good.items() if k != "1.bias"}, source="w")
    with pytest.raises(MheError, match=r"holds 1 weight\(s\) the model does not have: extra$"):
        load_state_strict(model, {**good, "extra": torch.zeros(1)}, source="w")
    many = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(4)])  # 8 weights, 7 missing
    with pytest.raises(MheError, match=r"lacks 7 weight\(s\) the model needs: 0.bias, 1.weight, 1.bias, 2.weight, "
                                       r"2.bias and 2 more$"):
        load_state_strict(many, {"0.weight": torch.zeros(2, 2)}, source="w")
    with pytest.raises(MheError, match=r"^w: weight '0.weight' has shape \(2, 4\), the model needs \(2, 3\)$"):
        load_state_strict(model, {**good, "0.weight": torch.zeros(2, 4)}, source="w")
    new = {k: torch.full_like(v, 7.0) for k, v in good.items()}
    load_state_strict(model, {k: v for k, v in new.items() if k != "1.bias"}, source="w",
                      allow_missing=["1.bias"], allow_unexpected=[])
    assert torch.equal(model[0].weight, new["0.weight"]) and torch.equal(model[1].bias, good["1.bias"])


def test_replaced_best_weights_are_detected(tmp_path):
    task = ScriptedTask([0.5, 0.1])
    Trainer(tiny_run("train.eval_every=3"), task, tmp_path, log=quiet).fit()
    weights = tmp_path / "best" / "model.safetensors"
    unrelated = {k: torch.randn_like(v) for k, v in load_file(str(weights)).items()}
    save_file(unrelated, str(weights))
    model = RecallTask().setup(tiny_run(), tmp_path, None)
    with pytest.raises(MheError, match=r"best cannot be loaded: model.safetensors does not match its checksum"):
        load_best(tmp_path, model)
    from mhe.tasks.runs import load_run

    with pytest.raises(MheError, match="does not match its checksum"):
        load_run(tmp_path)


def test_a_checkpoint_of_another_shape_is_refused_with_both_shapes(tmp_path):
    Trainer(tiny_run("train.stop_at=3"), RecallTask(), tmp_path, log=quiet).fit()
    wider = RecallTask().setup(tiny_run("model.d_ff=128"), tmp_path, None)
    with pytest.raises(MheError, match=r"model.safetensors: weight 'decoder.layers.0.ffn.fc_in.bias' has shape "
                                       r"\(64,\), the model needs \(128,\)$"):
        load_weights(ckpt.latest_checkpoint(tmp_path / "checkpoints"), wider)


# ---------------------------------------------------------------- malformed run files
@pytest.fixture
def finished_run(tmp_path):
    Trainer(tiny_run("train.steps=2", "train.save_every=0"), RecallTask(), tmp_path, log=quiet).fit()
    return tmp_path


@pytest.mark.parametrize("damage, match", [
    (lambda t: t[: len(t) // 2], r"config.json: malformed JSON \("),
    (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != "run"}),
     r"config.json: no 'run' object \(truncated or not written by mhe\)"),
    (lambda t: json.dumps({**json.loads(t), "run": {**json.loads(t)["run"], "colour": 1}}),
     r"config.json: unknown run configuration key 'colour'; valid keys: task, preset"),
    (lambda t: json.dumps({**json.loads(t), "run": {**json.loads(t)["run"], "train": {"lrr": 1}}}),
     r"config.json: unknown setting 'train.lrr'; valid train keys: steps"),
    (lambda t: "[1, 2]", r"config.json: must be a JSON object, got list"),
])
def test_a_damaged_config_is_one_line_naming_the_file(finished_run, damage, match):
    path = finished_run / "config.json"
    path.write_text(damage(path.read_text()))
    with pytest.raises(MheError, match=match) as e:
        read_run_config(finished_run)
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_a_damaged_config_on_resume_is_exit_2_without_traceback(tmp_path, capsys):
    assert main(TRAIN + ["--out", str(tmp_path), "--set", "train.stop_at=1"]) == 0
    (tmp_path / "config.json").write_text('{"run": {"task": "recall"')
    capsys.readouterr()
    assert main(TRAIN + ["--out", str(tmp_path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json: malformed JSON" in err


def test_a_corrupt_tokenizer_is_named(tmp_path):
    from mhe.data.tokenize import load_tokenizer

    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    with pytest.raises(MheError, match=r"tokenizer.json: not a readable tokenizer \(") as e:
        load_tokenizer(tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("content, match", [
    (None, r"run.json does not exist \(a run configuration was expected\)"),
    ("{not json", r"run.json: malformed JSON \(Expecting property name"),
    ('{"task": "recall", "preset": "tiny-decoder", "speed": 3}', r"run.json: unknown run configuration key 'speed'"),
    ('{"preset": "tiny-decoder"}', r"run.json: the run configuration needs .task."),
])
def test_mhe_run_config_errors(tmp_path, capsys, content, match):
    path = tmp_path / "run.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(MheError, match=match):
        read_run_config_file(path)
    assert main(["run", "--config", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "run.json" in err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- fine-tuning starts
@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from conftest import require_data

    root = require_data("ptb/ptb.train.txt.gz", "glue/RTE/train.tsv.gz", "glue/RTE/dev.tsv.gz")
    out = tmp_path_factory.mktemp("pre") / "encoder"
    assert main(["pretrain", "--preset", "tiny-encoder", "--data", "ptb", "--data-dir", str(root), "--out", str(out),
                 "--set", "train.steps=2", "--set", "train.progress=false", "--set", "data.limit_lines=200",
                 "--set", "data.vocab_size=300"]) == 0
    return root, out


def _finetune_model(pretrained, tmp_path, *overrides):
    from mhe.tasks.finetune import FinetuneTask
    from mhe.tasks.finetune_config import finetune_config
    from mhe.training.distributed import Dist

    root, run = pretrained
    cfg = finetune_config("rte", str(run), data_dir=str(root),
                          overrides=['data.task_options={"train_limit": 8, "dev_limit": 8}', *overrides])
    return FinetuneTask().setup(cfg, tmp_path / "ft", Dist())


def test_finetuning_starts_from_the_pretrained_weights(pretrained, tmp_path):
    from mhe.models import MODEL_CLASSES

    model = _finetune_model(pretrained, tmp_path)
    source = load_file(str(ckpt.latest_checkpoint(pretrained[1] / "checkpoints") / "model.safetensors"))
    encoder = {k: v for k, v in model.state_dict().items() if k.startswith("encoder.")}
    assert len(encoder) > 10
    for k, v in encoder.items():
        assert torch.equal(v, source[k]), k
    torch.manual_seed(1)
    fresh = MODEL_CLASSES[(model.cfg.arch, model.cfg.head)](model.cfg).state_dict()
    differ = [k for k, v in encoder.items() if not torch.equal(v, fresh[k])]
    assert "encoder.embed.tokens.weight" in differ and len(differ) > len(encoder) // 2
    assert not any(k.startswith("encoder.") for k in set(fresh) - set(encoder))


def test_finetuning_refuses_a_backbone_of_another_shape(pretrained, tmp_path):
    with pytest.raises(MheError, match=r"weight 'encoder.layers.0.ffn.fc_in.bias' has shape \(256,\), "
                                       r"the model needs \(128,\)$"):
        _finetune_model(pretrained, tmp_path, "model.d_ff=128")


def test_a_sweep_stopped_by_sigterm_exits_143(monkeypatch, capsys):
    """Commands that run several trainings (compare) raise RunInterrupted; main exits 128 + signal."""
    from mhe import cli
    from mhe.training.loop import RunInterrupted

    cli.build_parser()

    def stopped(args):
        raise RunInterrupted(signal.SIGTERM)

    monkeypatch.setitem(cli.COMMANDS, "train", cli.COMMANDS["train"]._replace(run=stopped))
    assert main(TRAIN + ["--out", "unused"]) == 143
    assert capsys.readouterr().err == "mhe train: interrupted\n"


def test_a_fresh_start_drops_the_records_of_an_attempt_killed_before_its_first_checkpoint(tmp_path):
    Trainer(tiny_run("train.stop_at=2", "train.save_every=0"), RecallTask(), tmp_path, log=quiet).fit()
    shutil.rmtree(tmp_path / "checkpoints")
    messages = []
    Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=messages.append).fit()  # nothing to resume from
    assert any("starting from step 0" in m for m in messages)
    assert steps_logged(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_finetune_resume_where_there_is_no_run_exits_2(pretrained, tmp_path, capsys):
    root, run = pretrained
    out = tmp_path / "nothing-here"
    assert main(["finetune", "--task", "rte", "--checkpoint", str(run), "--data-dir", str(root), "--out", str(out),
                 "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"there is no run in {out}" in err and not out.exists()


# ---------------------------------------------------------------- evaluation precision
class PrecisionTask(RecallTask):
    """Recall whose evaluations record the autocast they ran under."""

    def __init__(self):
        self.seen, self.grad = [], []

    def _autocast(self, model):
        dev = next(model.parameters()).device.type
        return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None

    def evaluate(self, model):
        self.seen.append(("evaluate", self._autocast(model)))
        self.grad.append(torch.is_grad_enabled())
        return {"accuracy": 0.5}

    def final(self, model):
        self.seen.append(("final", self._autocast(model)))
        self.grad.append(torch.is_grad_enabled())
        return {"score": 0.0}


@pytest.mark.parametrize("setting, want", [("float32", None), ("tf32", None), ("train", torch.bfloat16)])
def test_evaluations_run_in_float32_or_under_the_training_autocast(setting, want, tmp_path):
    """``data.eval_precision``: float32 and tf32 (the default; plain float32 on a CPU) evaluate
    without autocast; ``train`` under ``train.precision``'s (bf16 here, on the CPU), the
    validations and the final evaluation alike, all without autograd. The setting leaves the run's identity alone (it
    changes how evaluations round, not what trains)."""
    task = PrecisionTask()
    cfg = tiny_run("train.precision=bf16", "train.eval_every=3", f"data.eval_precision={setting}")
    Trainer(cfg, task, tmp_path, log=quiet).fit()
    assert task.seen == [("evaluate", want), ("evaluate", want), ("final", want)]
    assert task.grad == [False, False, False]  # the final evaluation too runs without autograd
    assert cfg.hash() == tiny_run("train.precision=bf16", "train.eval_every=3").hash()
    assert tiny_run().data.eval_precision == "tf32"


PER_BACKEND = hasattr(torch.backends.cuda.matmul, "fp32_precision")  # torch >= 2.9
needs_per_backend = pytest.mark.skipif(not PER_BACKEND, reason="torch before 2.9 has no per-backend fp32 setting")


@needs_per_backend
@pytest.mark.parametrize("setting, device, tf32", [("tf32", "cuda", True), ("tf32", "cpu", False),
                                                   ("float32", "cuda", False)])
def test_tf32_evaluation_allows_tf32_products_on_a_gpu_only_and_restores_the_setting(setting, device, tf32):
    """``tf32`` sets CUDA float32 matrix products to TF32 for the evaluation on a CUDA device and
    puts the previous setting back after, also when the evaluation raises; a CPU evaluation and
    ``float32`` leave it as it was. (The context only sets a flag: no GPU is needed.)"""
    from mhe.training.step import evaluation_precision

    matmul = torch.backends.cuda.matmul
    cfg = tiny_run(f"data.eval_precision={setting}")
    before = matmul.fp32_precision
    with evaluation_precision(cfg, torch.device(device)):
        assert matmul.fp32_precision == ("tf32" if tf32 else before)
    assert matmul.fp32_precision == before
    with pytest.raises(ValueError), evaluation_precision(cfg, torch.device(device)):
        raise ValueError
    assert matmul.fp32_precision == before


@needs_per_backend
@pytest.mark.parametrize("caller", ["ieee", "tf32"])
def test_tf32_evaluation_works_under_a_callers_per_backend_precision_and_restores_it(caller):
    """A caller who set torch's per-backend float32 precision (after which reading the process-wide
    level raises) still evaluates with ``tf32``, and finds their setting as they left it."""
    from mhe.training.step import evaluation_precision

    matmul = torch.backends.cuda.matmul
    found = matmul.fp32_precision
    matmul.fp32_precision = caller
    try:
        with evaluation_precision(tiny_run("data.eval_precision=tf32"), torch.device("cuda")):
            assert matmul.fp32_precision == "tf32"
        assert matmul.fp32_precision == caller
    finally:
        matmul.fp32_precision = found


PRECISION_PROBE = r"""
import torch
from mhe.training.step import float32_matmuls
cuda, cpu = torch.backends.cuda.matmul, torch.backends.mkldnn.matmul
caller = {caller!r}
if caller:  # a caller who used torch's per-backend setting (reading the process-wide level then raises)
    cuda.fp32_precision = caller
before = (cuda.fp32_precision, cpu.fp32_precision)
for mode in ("tf32", "ieee"):
    with float32_matmuls(mode):
        level = torch.get_float32_matmul_precision()  # raised inside before the fix, in a default process
        assert level == ("high" if mode == "tf32" else "highest"), level
        assert cuda.allow_tf32 is (mode == "tf32")
        assert cuda.fp32_precision == mode
    assert (cuda.fp32_precision, cpu.fp32_precision) == before, ((cuda.fp32_precision, cpu.fp32_precision), before)
torch.get_float32_matmul_precision()  # readable after, too
print("ok")
"""


@needs_per_backend
@pytest.mark.parametrize("caller", [None, "tf32", "ieee"])
def test_float32_matmuls_keeps_the_process_wide_level_readable_inside_and_after(caller):
    """Inside and after a ``tf32`` (or ``ieee``) block, code can read the process-wide float32 level
    (inductor's max-autotune and a user's task code do), in a default process and after a caller used
    the per-backend setting; the caller's per-backend values come back exactly. A fresh interpreter,
    since the per-backend state is process-wide."""
    out = subprocess.run([sys.executable, "-c", PRECISION_PROBE.format(caller=caller)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
