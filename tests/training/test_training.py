"""The training engine: schedules, exact resume, interruption, corrupt checkpoints, non-finite stops."""

import json
import os
import shutil
import signal

import pytest
import torch

from mhe.errors import MheError
from mhe.tasks.recall import RecallTask
from mhe.training import checkpoint as ckpt
from mhe.training.atomic import seal_and_place
from mhe.training.config import RunConfig, apply_overrides
from mhe.tasks import default_run, run_config_from_dict
from mhe.training.loop import Trainer, TrainingStopped
from mhe.training.optim import lr_factor

SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.dropout=0.1", "model.attn_dropout=0.1",
         'data.task_options={"train_size": 256, "test_size": 64, "pairs": 4, "queries": 4}',
         "train.batch_size=16", "train.steps=12", "train.log_every=1", "train.save_every=4", "train.progress=false",
         "train.warmup_steps=2"]


def tiny_run(kind="mhe-mul", extra=()):
    return apply_overrides(default_run("recall", "tiny-decoder", kind), SMALL + list(extra))


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def quiet(*_):
    pass


def test_schedules():
    assert lr_factor(0, schedule="linear", warmup=10, total=110) == pytest.approx(0.1)
    assert lr_factor(9, schedule="linear", warmup=10, total=110) == pytest.approx(1.0)
    assert lr_factor(60, schedule="linear", warmup=10, total=110) == pytest.approx(0.5)
    assert lr_factor(110, schedule="linear", warmup=10, total=110) == 0.0
    assert lr_factor(60, schedule="cosine", warmup=10, total=110) == pytest.approx(0.5)
    # two hard restarts: back at the peak half-way through the decay
    assert lr_factor(59, schedule="cosine_restarts", warmup=10, total=110, restarts=2) < 0.01
    assert lr_factor(60, schedule="cosine_restarts", warmup=10, total=110, restarts=2) == pytest.approx(1.0)
    assert lr_factor(35, schedule="cosine_restarts", warmup=10, total=110, restarts=2) == pytest.approx(0.5)
    assert lr_factor(39, schedule="inverse_sqrt", warmup=10, total=100) == pytest.approx(0.5)
    assert lr_factor(50, schedule="constant", warmup=10, total=100) == 1.0


def test_exact_resume_gives_identical_losses(tmp_path):
    """N steps straight vs stopped at k and resumed: the same loss at every step (dropout on)."""
    straight = Trainer(tiny_run(), RecallTask(), tmp_path / "a", log=quiet).fit()
    assert straight["status"] == "finished"
    first = Trainer(tiny_run(extra=["train.stop_at=5"]), RecallTask(), tmp_path / "b", log=quiet).fit()
    assert first["status"] == "stopped" and first["step"] == 5
    messages = []
    second = Trainer(tiny_run(), RecallTask(), tmp_path / "b", resume=True, log=messages.append).fit()
    assert second["status"] == "finished"
    assert any("resuming from" in m and "step-00000005" in m for m in messages)
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(a) == len(b) == 12
    assert a == b  # bit-for-bit on the CPU
    ra, rb = (json.loads((tmp_path / d / "results.json").read_text()) for d in "ab")
    assert ra["score"] == rb["score"]


def test_run_directory_contract(tmp_path):
    Trainer(tiny_run(), RecallTask(), tmp_path, log=quiet).fit()
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["run"]["train"]["steps"] == 12 and cfg["attention_params"] > 0
    assert cfg["device"].startswith("cpu (") and cfg["torch"] == torch.__version__
    res = json.loads((tmp_path / "results.json").read_text())
    assert {"task", "metric", "score", "attention", "attention_params", "seed", "steps"} <= set(res)
    assert res["metric"] == "accuracy" and 0 <= res["score"] <= 1
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step-00000008", "step-00000012"]  # keep_last=2
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000012" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "trainer.safetensors", "trainer.json"}


def test_keep_checkpoints_false_frees_the_disk_and_keeps_the_best_weights_result(tmp_path):
    """The best-weights score must be the same whether or not the files are kept afterwards."""
    extra = ["train.eval_every=4"]
    kept = Trainer(tiny_run(extra=extra), RecallTask(), tmp_path / "kept", log=quiet).fit()
    assert (tmp_path / "kept" / "best" / "model.safetensors").exists()
    freed = Trainer(tiny_run(extra=extra + ["train.keep_checkpoints=false"]), RecallTask(), tmp_path / "freed",
                    log=quiet).fit()
    assert freed["score"] == kept["score"] and freed["status"] == "finished"
    assert not (tmp_path / "freed" / "checkpoints").exists() and not (tmp_path / "freed" / "best").exists()
    assert (tmp_path / "freed" / "results.json").exists()
    # an interrupted run keeps its checkpoint whatever the setting: it must be able to resume
    stopped = Trainer(tiny_run(extra=extra + ["train.keep_checkpoints=false", "train.stop_at=6"]), RecallTask(),
                      tmp_path / "stopped", log=quiet).fit()
    assert stopped["status"] == "stopped"
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "stopped" / "checkpoints")][-1] == "step-00000006"


def test_corrupt_and_incomplete_checkpoints_are_skipped(tmp_path):
    Trainer(tiny_run(extra=["train.keep_last=3"]), RecallTask(), tmp_path, log=quiet).fit()
    root = tmp_path / "checkpoints"
    newest, middle = ckpt.list_checkpoints(root)[-1], ckpt.list_checkpoints(root)[-2]
    with open(newest / "model.safetensors", "r+b") as f:  # flip bytes in the newest
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    (middle / "manifest.json").unlink()  # the one before: an interrupted write
    reports = []
    found = ckpt.latest_checkpoint(root, report=reports.append)
    assert found == ckpt.list_checkpoints(root)[-3]
    assert "does not match its checksum" in reports[0] and "no manifest" in reports[1]
    with pytest.raises(MheError, match="cannot be loaded: model.safetensors does not match"):
        ckpt.load_checkpoint(newest, model=torch.nn.Linear(1, 1))


class InterruptingTask(RecallTask):
    """Sends SIGINT to its own process while building the batch of step 3."""

    calls = 0

    def collate(self, indices):
        InterruptingTask.calls += 1
        if InterruptingTask.calls == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return super().collate(indices)


def test_sigint_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    messages = []
    res = Trainer(tiny_run(), InterruptingTask(), tmp_path, log=messages.append).fit()
    assert res["status"] == "interrupted" and res["step"] == 3
    assert ckpt.latest_checkpoint(tmp_path / "checkpoints").name == "step-00000003"
    assert any("interrupted at step 3" in m and "--resume" in m for m in messages)
    assert not (tmp_path / "results.json").exists()
    res = Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=quiet).fit()
    assert res["status"] == "finished" and res["step"] == 12


class NaNTask(RecallTask):
    def loss(self, model, batch, **kw):
        loss, n = super().loss(model, batch, **kw)
        self.k = getattr(self, "k", 0) + 1
        return (loss * float("nan") if self.k == 6 else loss), n


def test_non_finite_loss_stops_with_step_and_last_checkpoint(tmp_path):
    with pytest.raises(TrainingStopped, match=r"non-finite loss \(nan\) at step 6; stopped; last good checkpoint: .*step-00000004"):
        Trainer(tiny_run(), NaNTask(), tmp_path, log=quiet).fit()


def test_output_folder_with_other_configuration_is_refused(tmp_path):
    first = Trainer(tiny_run(), RecallTask(), tmp_path, log=quiet).fit()
    with pytest.raises(MheError, match=r"different configuration \(train.lr: 0.003 there, 0.01 now\); "
                                       r"choose another --out \(.*-2 is free\)"):
        Trainer(tiny_run(extra=["train.lr=0.01"]), RecallTask(), tmp_path, log=quiet).fit()
    messages = []  # the same configuration, finished: reported, not trained again
    again = Trainer(tiny_run(), RecallTask(), tmp_path, log=messages.append).fit()
    assert again == first and messages == [f"already finished: results in {tmp_path}"]


def test_an_unfinished_run_continues_only_with_resume(tmp_path):
    Trainer(tiny_run(extra=["train.stop_at=5"]), RecallTask(), tmp_path, log=quiet).fit()
    with pytest.raises(MheError, match=r"holds an unfinished run of this configuration \(its newest checkpoint is "
                                       r"step-00000005\); pass --resume to continue it"):
        Trainer(tiny_run(), RecallTask(), tmp_path, log=quiet).fit()
    assert Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=quiet).fit()["status"] == "finished"


class ModeWatchTask(RecallTask):
    """Records, at every batch, whether torch's deterministic mode is on; with ``alert`` it also
    calls an operation without a deterministic kernel on the CPU (``put_`` without accumulation)."""

    def __init__(self, alert=False):
        super().__init__()
        self.seen, self.alert = [], alert

    def collate(self, indices):
        self.seen.append(torch.are_deterministic_algorithms_enabled())
        if self.alert:
            torch.zeros(2).put_(torch.tensor([0]), torch.tensor([1.0]))
        return super().collate(indices)


def test_train_deterministic_holds_for_the_run_alone_and_a_resume_may_change_it(tmp_path, monkeypatch):
    """``train.deterministic=true`` turns torch's deterministic mode on for the run's steps, puts
    cuBLAS's reproducible workspace setting in the environment, and gives the mode back when the run
    ends; it changes how a run computes, not what, so a resume without it goes on (same hash)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", "")  # recorded, so the test's setting is undone after it
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    task = ModeWatchTask()
    first = Trainer(tiny_run(extra=["train.deterministic=true", "train.stop_at=5"]), task, tmp_path, log=quiet).fit()
    assert first["status"] == "stopped" and task.seen and all(task.seen)
    assert not torch.are_deterministic_algorithms_enabled()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    again = ModeWatchTask()
    assert Trainer(tiny_run(), again, tmp_path, resume=True, log=quiet).fit()["status"] == "finished"
    assert again.seen and not any(again.seen)


def test_an_operation_without_a_deterministic_kernel_stops_a_deterministic_run_in_one_line(tmp_path):
    with pytest.raises(MheError, match=r"^train.deterministic=true: put_ has no deterministic kernel in torch; "
                                       r"set train.deterministic=false for this model$"):
        Trainer(tiny_run(extra=["train.deterministic=true"]), ModeWatchTask(alert=True), tmp_path, log=quiet).fit()
    assert not torch.are_deterministic_algorithms_enabled()
    Trainer(tiny_run(), ModeWatchTask(alert=True), tmp_path / "b", log=quiet).fit()  # the same task without it


@pytest.mark.parametrize("item, match", [
    ("train.lrr=1", "unknown setting 'train.lrr'; valid train keys: steps, epochs, batch_size"),
    ("model.colour=1", "unknown setting 'model.colour'; valid model keys:"),
    ("optim.lr=1", "unknown --set section 'optim'; valid: train, data, model"),
    ("train.steps=abc", "train.steps='abc' is not allowed; train.steps takes an integer"),
    ("train.schedule=wavy", "train.schedule='wavy' is not allowed; train.schedule takes one of linear, cosine"),
    ("train.steps", "--set takes KEY=VALUE"),
])
def test_bad_set_keys(item, match):
    with pytest.raises(MheError, match=match):
        apply_overrides(default_run("lm", "tiny-decoder", "mha"), [item])


def test_config_round_trip_and_hash():
    cfg = tiny_run()
    again = run_config_from_dict(json.loads(json.dumps(cfg.to_dict())), source="test")
    assert again.hash() == cfg.hash()
    assert tiny_run(extra=["train.stop_at=3"]).hash() == cfg.hash()  # stopping early is the same run
    assert tiny_run(extra=["train.seed=1"]).hash() != cfg.hash()


# ---------------------------------------------------------------- every part of a checkpoint checked
def _shift_step(s):
    s["step"] = 7


def _reshape_moment(s):
    s["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 5)


def _break_rng(s):
    s["rng"]["tensors"]["torch_cpu"] = torch.zeros(7, dtype=torch.uint8)


def _break_python_rng(s):
    s["rng"]["meta"]["python"] = [3, [1, 2], None]


def _move_schedule(s):
    s["scheduler"]["last_epoch"] = 3


def _other_hash(s):
    s["config_hash"] = "0" * 16


def _data_past_the_epoch(s):
    s["data"]["index"] = 10_000


def test_the_trainer_state_is_read_onto_the_cpu_whatever_device_the_weights_go_to(tmp_path, monkeypatch):
    """A GPU run resumes with map_location on its card; the random generators' states must stay
    CPU byte tensors (read onto the card, every checkpoint was refused and the run started over),
    so the state file is read onto the CPU and only the weights onto the map location."""
    Trainer(tiny_run(extra=["train.stop_at=4"]), RecallTask(), tmp_path / "b", log=quiet).fit()
    newest = ckpt.list_checkpoints(tmp_path / "b" / "checkpoints")[-1]
    asked, real = {}, ckpt.load_file

    def load_file(path, device="cpu"):  # the CPU machine has no card: record the device, read on the CPU
        asked[os.path.basename(path)] = device
        return real(path, device="cpu")
    monkeypatch.setattr(ckpt, "load_file", load_file)
    model = RecallTask().setup(tiny_run(), tmp_path / "scratch", None)
    found = ckpt.resumable_checkpoint(tmp_path / "b" / "checkpoints", model=model, check=lambda state, step: None,
                                      map_location="cuda:1")
    assert found is not None and found[0] == newest
    assert asked == {ckpt.WEIGHTS: "cuda:1", ckpt.STATE_TENSORS: "cpu"}


@pytest.mark.parametrize("damage, problem", [
    (_shift_step, "trainer.json: step 7, but the folder is step 8"),
    (_reshape_moment, "trainer.safetensors: optimizer/state/0/exp_avg has shape (3, 5), its parameter"),
    (_break_rng, "trainer.safetensors: rng/tensors/torch_cpu is not a torch generator state"),
    (_break_python_rng, "trainer.json: rng/meta/python is not a Python random state"),
    (_move_schedule, "trainer.json: the schedule is at step 3, the checkpoint at 8"),
    (_other_hash, "trainer.json: configuration hash '0000000000000000'"),
    (_data_past_the_epoch, "trainer.json: data position"),
])
def test_a_checkpoint_that_disagrees_is_skipped_like_a_bad_checksum(tmp_path, damage, problem):
    """A state that passes its checksum but disagrees with its folder, the model or itself: one
    line naming the file and the disagreement, then the previous checkpoint, and the resumed run
    ends with the same losses as a straight one."""
    straight = Trainer(tiny_run(), RecallTask(), tmp_path / "a", log=quiet).fit()
    Trainer(tiny_run(extra=["train.stop_at=8"]), RecallTask(), tmp_path / "b", log=quiet).fit()
    newest = ckpt.list_checkpoints(tmp_path / "b" / "checkpoints")[-1]
    state = ckpt.read_trainer_state(newest)
    damage(state)
    ckpt.rewrite_trainer_state(newest, state)  # sealed again: the checksum passes
    messages = []
    res = Trainer(tiny_run(), RecallTask(), tmp_path / "b", resume=True, log=messages.append).fit()
    skipped = [m for m in messages if m.startswith("skipping checkpoint")]
    assert len(skipped) == 1 and str(newest) in skipped[0] and problem in skipped[0], messages
    assert any("resuming from" in m and "step-00000004" in m for m in messages)
    assert res["step"] == 12 and losses(tmp_path / "a") == losses(tmp_path / "b")
    assert res["score"] == straight["score"]


def test_a_checkpoint_of_the_earlier_layout_names_the_migration(tmp_path):
    Trainer(tiny_run(extra=["train.stop_at=4"]), RecallTask(), tmp_path, log=quiet).fit()
    point = ckpt.list_checkpoints(tmp_path / "checkpoints")[-1]
    (point / "trainer.safetensors").rename(point / "optimizer.safetensors")  # as the seven-file layout named it
    (point / "manifest.json").unlink()
    shutil.copytree(point, tmp_path / "old")
    seal_and_place(tmp_path / "old", point)  # sealed: the checksums pass
    with pytest.raises(MheError, match=r"is in the earlier layout .*; convert the run with: "
                                       r"python benchmarks/results_tools.py migrate " + str(tmp_path)):
        Trainer(tiny_run(), RecallTask(), tmp_path, resume=True, log=quiet).fit()


def test_nested_state_flattens_into_tensors_and_json_and_back():
    from mhe.training.flat_state import flatten, unflatten

    state = {"step": 3, "optimizer": {"state": {0: {"exp_avg": torch.arange(6.0).view(2, 3), "step": torch.tensor(3.0)},
                                                 5: {"m": torch.ones(2)}},
                                       "param_groups": [{"params": [0, 5], "betas": (0.9, 0.98), "lr": 1e-3}]},
             "best": None, "rng": {"tensors": {"torch_cpu": torch.get_rng_state()}, "meta": {"python": [3, [1], None]}}}
    tensors, skeleton = flatten(state)
    assert sorted(tensors) == ["optimizer/state/0/exp_avg", "optimizer/state/0/step", "optimizer/state/5/m",
                               "rng/tensors/torch_cpu"]
    back = unflatten(json.loads(json.dumps(skeleton)), tensors)
    assert list(back["optimizer"]["state"]) == [0, 5]  # integer keys stay integers
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"])
    assert back["optimizer"]["param_groups"][0]["betas"] == [0.9, 0.98] and back["best"] is None
    with pytest.raises(TypeError, match="cannot save a set"):
        flatten({"x": {1, 2}})


def test_a_padded_vocabularys_checkpoint_passes_its_checks():
    """On a GPU the trainer pads the vocabulary; its moments are saved with the real rows, so the
    checks compare against the shapes the state dict saves, not the padded parameters'."""
    from mhe.models import build_model
    from mhe.models.vocab_padding import pad_optimizer_state, pad_vocabulary
    from mhe.training.batches import BatchOrder
    from mhe.training.optim import build_optimizer
    from mhe.training.state import TrainerState
    from mhe.training.state_check import saved_shapes

    model = build_model("tiny-encoder", vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=1)
    pad_vocabulary(model)
    opt, sched = build_optimizer(model, tiny_run().train)
    pad_optimizer_state(opt, model)
    ids = torch.randint(0, 99, (2, 7))
    model(ids, labels=ids).loss.backward()
    opt.step()
    sched.step()
    state = TrainerState(opt, sched, BatchOrder(64, 8, seed=0), config_hash="h", step=1)
    saved = state.state_dict()
    assert state.problem(saved, 1, saved_shapes(model)) is None
    assert "has shape (99, 32), its parameter (128, 32)" in state.problem(saved, 1)  # the padded shapes: refused


class FirstWeights(RecallTask):
    """Recall that keeps the weights its first training step sees."""

    first = None

    def loss(self, model, batch, **kw):
        if self.first is None:
            self.first = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return super().loss(model, batch, **kw)


def test_a_checkpoint_of_weights_alone_resumes_on_its_weights_with_a_fresh_trainer_state(tmp_path):
    """``mhe convert`` writes its step 0 as weights alone (no optimiser, schedule or data order):
    a run resumed there trains every step from those weights (they would be skipped as a
    checkpoint without a trainer state, and the run start from a fresh initialisation)."""
    Trainer(tiny_run(extra=["train.stop_at=4"]), RecallTask(), tmp_path, log=quiet).fit()
    step4 = ckpt.list_checkpoints(tmp_path / "checkpoints")[-1]
    model = RecallTask().setup(tiny_run(), tmp_path / "scratch", None)
    ckpt.load_checkpoint(step4, model=model)  # trained weights: not what a fresh model starts with
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "metrics.jsonl").unlink()
    ckpt.save_weights(tmp_path / "checkpoints", model=model)
    manifest = json.loads((tmp_path / "checkpoints" / "step-00000000" / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors"}
    task, messages = FirstWeights(), []
    res = Trainer(tiny_run(), task, tmp_path, resume=True, log=messages.append).fit()
    assert any("resuming from" in m and "step-00000000 (step 0)" in m for m in messages), messages
    assert res["status"] == "finished" and res["step"] == 12 and len(losses(tmp_path)) == 12
    for k, v in model.state_dict().items():
        assert torch.equal(task.first[k], v), k
