"""benchmarks/kill_trials.py: its checks catch what they are there to catch (a torn checkpoint, a
resumed loss or weight that differs, a missing step), and, in the slow tier, a few real trials on
the CPU (one process, then two-process gloo DDP and FSDP) are killed, resumed and pass."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kill_trials  # noqa: E402


def test_a_step_folder_without_a_valid_manifest_counts_as_torn(tmp_path):
    from mhe.training.atomic import new_temp_folder, seal_and_place
    root = tmp_path / "run" / "checkpoints"
    tmp = new_temp_folder(root, "step-00000001")
    (tmp / "model.safetensors").write_bytes(b"weights")
    seal_and_place(tmp, root / "step-00000001", step=1)
    (root / "step-00000002").mkdir()  # named like a checkpoint, never sealed
    (root / "step-00000002" / "model.safetensors").write_bytes(b"half")
    (root / ".tmp-step-00000003-1").mkdir()  # a write in progress: not a checkpoint
    assert kill_trials.left_checkpoints(tmp_path / "run") == (1, 1)


def test_the_gap_sees_a_differing_loss_weight_or_key():
    a = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}, {"step": 2, "loss": 1.5, "grad_norm": 0.5}]
    b = [dict(r) for r in a]
    assert kill_trials.gap(a, b) == 0.0
    b[1]["loss"] = 1.5 + 2 ** -20
    assert kill_trials.gap(a, b) == 2 ** -20
    w = {"x": torch.ones(3)}
    assert kill_trials.gap(w, {"x": torch.ones(3)}) == 0.0
    assert kill_trials.gap(w, {"x": torch.tensor([1.0, 1.0, 1.25])}) == 0.25
    assert kill_trials.gap(w, {"y": torch.ones(3)}) == float("inf")


def test_a_trial_passes_only_if_nothing_was_lost():
    """A resume that set a whole checkpoint aside started over: the losses repeat, yet steps were
    lost (on the GPU every resume once did so), so the trial fails; as it does for a gap or a hang."""
    good = {"resume_exit": 0, "loss_gap": 0.0, "weight_gap": 0.0, "tolerance": 0.0, "hung_workers": 0, "set_aside": 0}
    assert kill_trials.passed(good) and kill_trials.passed({**good, "complete": True})
    for bad in ({"set_aside": 3}, {"loss_gap": 2 ** -20}, {"weight_gap": float("inf")}, {"hung_workers": 1},
                {"resume_exit": 1}, {"complete": False, "tolerance": float("inf")}):
        assert not kill_trials.passed({**good, **bad}), bad


def _fake_trials(tmp_path, monkeypatch, ok=True):
    """kill_trials with its runs replaced: every trial takes 10 s of a fake clock and passes (or not)."""
    clock = [0.0]
    monkeypatch.setattr(kill_trials, "CLOCK", lambda: clock[0])
    refs = ([tmp_path / "a", tmp_path / "b"], 1.0)
    monkeypatch.setattr(kill_trials, "reference", lambda work, s, n, steps, dev: refs)
    monkeypatch.setattr(kill_trials, "records", lambda out: [])
    monkeypatch.setattr(kill_trials, "final_weights", lambda out, steps: {})

    def trial(i, work, setup, opts, refs, wall, tol, rng):
        clock[0] += 10.0
        return {"trial": i, "setup": setup, "signal": rng.choice(sorted(kill_trials.SIGNALS)), "at_s": 1.0,
                "write_under_way": False, "torn_left": 0, "set_aside": 0 if ok else 1, "hung_workers": 0,
                "ok": ok, "resume_exit": 0, "loss_gap": 0.0, "weight_gap": 0.0, "tolerance": 0.0}
    monkeypatch.setattr(kill_trials, "trial", trial)


def test_a_deadline_stops_a_call_in_time_and_the_next_call_continues_the_count(tmp_path, monkeypatch):
    """Trials of 10 s against a 35-s deadline: three fit (the fourth would end at 40 s), exit 3; the
    next call numbers on from 3 to the 5 asked for, exit 0, and its summary counts all five."""
    _fake_trials(tmp_path, monkeypatch)
    args = ["--trials", "5", "--setups", "fsdp", "--work", str(tmp_path)]
    assert kill_trials.main(args + ["--deadline", "35"]) == 3
    assert kill_trials.main(args) == 0
    rows = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert [r["trial"] for r in rows] == [0, 1, 2, 3, 4]
    assert kill_trials.main(args) == 0  # nothing left to do: no trial added
    assert len((tmp_path / "trials.jsonl").read_text().splitlines()) == 5


def test_an_earlier_row_is_judged_again_and_a_cut_line_is_left_out(tmp_path, capsys):
    """A row an older harness passed with a checkpoint set aside fails now; a half-written last
    line (a call killed mid-write) is reported, not a crash of every later call."""
    row = {"trial": 0, "resume_exit": 0, "loss_gap": 0.0, "weight_gap": 0.0, "tolerance": 0.0, "hung_workers": 0,
           "set_aside": 3, "ok": True}
    (tmp_path / "trials.jsonl").write_text(json.dumps(row) + "\n" + '{"trial": 1, "resu')
    rows = kill_trials.earlier_trials(tmp_path)
    assert [r["trial"] for r in rows] == [0] and rows[0]["ok"] is False
    assert "trials.jsonl:2: not a JSON row" in capsys.readouterr().out


def test_a_failed_trial_of_an_earlier_call_still_fails_the_folder(tmp_path, monkeypatch):
    _fake_trials(tmp_path, monkeypatch, ok=False)
    args = ["--trials", "2", "--setups", "fsdp", "--work", str(tmp_path)]
    assert kill_trials.main(args + ["--deadline", "15"]) == 1  # one trial ran, and failed
    _fake_trials(tmp_path, monkeypatch, ok=True)
    assert kill_trials.main(args) == 1


@pytest.mark.slow
def test_killed_runs_resume_to_the_uninterrupted_losses(tmp_path, capsys):
    """Six trials (two per setup, signals and moments drawn from the seed): each passes, bit for bit."""
    assert kill_trials.main(["--trials", "6", "--setups", "single,ddp,fsdp", "--steps", "8", "--seed", "3",
                             "--work", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["setup"] for r in rows} == {"single", "ddp", "fsdp"}
    assert all(r["ok"] and r["loss_gap"] == 0.0 and r["weight_gap"] == 0.0 and r["torn_left"] == 0 for r in rows)
    assert "tolerance per setup" in capsys.readouterr().out
