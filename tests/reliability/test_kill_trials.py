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


@pytest.mark.slow
def test_killed_runs_resume_to_the_uninterrupted_losses(tmp_path, capsys):
    """Six trials (two per setup, signals and moments drawn from the seed): each passes, bit for bit."""
    assert kill_trials.main(["--trials", "6", "--setups", "single,ddp,fsdp", "--steps", "8", "--seed", "3",
                             "--work", str(tmp_path)]) == 0
    rows = [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["setup"] for r in rows} == {"single", "ddp", "fsdp"}
    assert all(r["ok"] and r["loss_gap"] == 0.0 and r["weight_gap"] == 0.0 and r["torn_left"] == 0 for r in rows)
    assert "tolerance per setup" in capsys.readouterr().out
