"""Sweep GPU placement: each parallel run sees one GPU, the parent's own entry of
CUDA_VISIBLE_DEVICES when the parent is already restricted."""

import subprocess
from types import SimpleNamespace

import pytest
import torch

from mhe.experiments import sweep as sweep_mod
from mhe.experiments.sweep import Sweep, gpu_for_slot


def placements(monkeypatch, tmp_path, visible, gpus, n_runs):
    """The CUDA_VISIBLE_DEVICES each run's subprocess was given (runs in job order)."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    seen = {}

    def fake_run(cmd, env, **kw):
        seen[cmd[cmd.index("--out") + 1]] = env.get("CUDA_VISIBLE_DEVICES")
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    sw = Sweep("recall", "tiny-decoder", ["mha"], n_runs)
    jobs = [("mha", s, tmp_path / f"mha-seed{s}") for s in range(n_runs)]
    sweep_mod._run_parallel(sw, jobs, workers=n_runs, log=lambda m: None)
    return [seen[str(run_dir)] for _, _, run_dir in jobs]


def test_restricted_parent_hands_out_its_own_entries(monkeypatch, tmp_path):
    assert placements(monkeypatch, tmp_path, "1,2,3", 3, 4) == ["1", "2", "3", "1"]


def test_uuids_are_handed_out_as_given(monkeypatch, tmp_path):
    assert placements(monkeypatch, tmp_path, "GPU-aa, GPU-bb", 2, 2) == ["GPU-aa", "GPU-bb"]


def test_unrestricted_parent_numbers_the_gpus(monkeypatch, tmp_path):
    assert placements(monkeypatch, tmp_path, None, 2, 3) == ["0", "1", "0"]


def test_no_gpu_leaves_the_environment_alone(monkeypatch, tmp_path):
    assert placements(monkeypatch, tmp_path, None, 0, 2) == [None, None]


@pytest.mark.parametrize("visible,gpus,slot,want", [("5,7", 2, 3, "7"), ("", 2, 1, "1"), ("4", 1, 2, "4")])
def test_gpu_for_slot(visible, gpus, slot, want):
    assert gpu_for_slot(slot, gpus, visible) == want
