"""``benchmarks/train_bench.py recall-step`` (``benchmarks/train/recall_step.py``): it trains the
grid's own run of a cell, refuses a cell the grid lacks, and reports a process's and the card's
time a step for each number of processes at once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from train import recall_step  # noqa: E402


def test_a_cell_or_entry_the_grid_lacks_is_refused_naming_what_it_has():
    with pytest.raises(SystemExit, match=r"no entry 'gqa' at length 32; entries \['mha', 'mhe-add', "):
        recall_step.grid_point("cpu-recall-zoology", 32, 32, "gqa")
    with pytest.raises(SystemExit, match=r"lengths \[32, 64\]"):
        recall_step.grid_point("cpu-recall-zoology", 128, 32, "mha")
    grid, point = recall_step.grid_point("cpu-recall-zoology", 64, 32, "mhe-mul rope-then-psi")
    assert (point.length, point.pairs, point.width, point.block.name, point.seed) == (64, 8, 32, "rotary", 0)


def test_the_table_names_the_card_and_each_row():
    row = dict(length=64, width=512, entry="mha", compiled=True, mps=True, processes=8, ms_a_step=80.0, card_ms_a_step=10.0,
               accuracy=0.5, gpu_busy_ms_a_step=2.5, kernels_a_step=300)
    text = recall_step.table([row], "NVIDIA H200")
    assert text.startswith("card: NVIDIA H200")
    assert "| 64 | 512 | mha | yes | yes | 8 | 80.00 | 10.00 | 2.50 | 300 | 0.500 |" in text


def test_mps_without_its_daemon_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(recall_step.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit) as done:
        recall_step.main(["--cpu-smoke", "--mps", "no,yes"])
    assert done.value.code == 2
    assert "--mps yes needs nvidia-cuda-mps-control" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        recall_step.main(["--mps", "maybe"])
    assert "--compiled and --mps take no, yes or no,yes (got 'no,yes', 'maybe')" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cpu_smoke_times_one_and_two_processes(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(BENCH / "train_bench.py"), "recall-step", "--cpu-smoke", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert [r["processes"] for r in got["rows"]] == [1, 2]
    for r in got["rows"]:
        assert r["ms_a_step"] > 0 and 0 <= r["accuracy"] <= 1 and "kernels_a_step" not in r  # no --profile
        assert r["card_ms_a_step"] == pytest.approx(r["ms_a_step"] / r["processes"], rel=1e-12)
