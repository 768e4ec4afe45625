"""``benchmarks/train_bench.py recall-step`` (``benchmarks/train/recall_step.py``): it trains the
grid's own run of a cell and block, refuses what the grid lacks, counts kernels and not the
ranges marked on the GPU's timeline, starts and stops the MPS daemon around its rows, and reports
a process's and the card's time a step for each number of processes at once."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from train import recall_step  # noqa: E402


def test_a_cell_or_entry_the_grid_lacks_is_refused_naming_what_it_has():
    with pytest.raises(SystemExit, match=r"no entry 'gqa' at length 32; entries \['mha', 'mhe-add', "
                                         r"'rotary:mhe-mul rope-then-psi'\], lengths \[32, 64\]"):
        recall_step.grid_point("cpu-recall-zoology", 32, 32, "gqa")
    with pytest.raises(SystemExit, match=r"no entry 'rotary:mha' at length 64"):
        recall_step.grid_point("cpu-recall-zoology", 64, 32, "rotary:mha")
    with pytest.raises(SystemExit, match=r"lengths \[32, 64\]"):
        recall_step.grid_point("cpu-recall-zoology", 128, 32, "mha")
    grid, point = recall_step.grid_point("cpu-recall-zoology", 64, 32, "mhe-mul rope-then-psi")
    assert (point.length, point.pairs, point.width, point.block.name, point.seed) == (64, 8, 32, "rotary", 0)


def test_block_and_entry_pick_the_block_an_entry_alone_the_first():
    _, rotary = recall_step.grid_point("gpu-recall-zoology", 128, 256, "rotary:mha")
    _, plain = recall_step.grid_point("gpu-recall-zoology", 128, 256, "mha")
    assert (rotary.block.name, rotary.entry, rotary.pairs) == ("rotary", "mha", 8)
    assert plain.block.name == "" and plain.block.preset != rotary.block.preset
    assert [recall_step.entry_label(p.block.name, p.entry) for p in (rotary, plain)] == ["rotary:mha", "mha"]


def event(name, us, *, device="CUDA", annotation=False):
    return SimpleNamespace(name=name, device_time=us, device_type=SimpleNamespace(name=device),
                           is_user_annotation=annotation)


def test_the_kernel_table_counts_kernels_not_annotated_ranges_or_host_events():
    events = [event("gemm", 30.0), event("gemm", 30.0), event("norm", 5.0), event("norm", 5.0),
              event("Optimizer.step#AdamW.step", 900.0, annotation=True), event("aten::mm", 50.0, device="CPU")]
    got = recall_step.kernel_table(events, 2, 1)
    assert got["kernels_a_step"] == 2 and got["gpu_busy_ms_a_step"] == pytest.approx(0.035, rel=1e-12)
    assert got["top_kernels"] == [{"name": "gemm", "a_step": 1.0, "us_a_step": 30.0}]


def test_the_mps_daemon_is_started_and_quit_around_the_block_and_the_environment_put_back(tmp_path, monkeypatch):
    log = tmp_path / "calls.log"
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(f'#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {log}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(recall_step, "MPS", str(fake))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with recall_step.mps_daemon(True):
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert Path(pipe).parent.is_dir()
    start, stop = log.read_text().splitlines()
    assert start.startswith(f"args=-d pipe={pipe}") and stop == f"args= pipe={pipe} stdin=quit"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not Path(pipe).parent.exists()
    with recall_step.mps_daemon(False):
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ


def test_the_table_names_the_card_and_each_row():
    row = dict(length=64, width=512, entry="rotary:mha", compiled=True, mps=True, processes=8, ms_a_step=80.0,
               card_ms_a_step=10.0, accuracy=0.5, gpu_busy_ms_a_step=2.5, kernels_a_step=300)
    text = recall_step.table([row], "NVIDIA H200")
    assert text.startswith("card: NVIDIA H200")
    assert "| 64 | 512 | rotary:mha | yes | yes | 8 | 80.00 | 10.00 | 2.50 | 300 | 0.500 |" in text


def test_graphs_rows_compile_and_replay_cuda_graphs_and_say_so():
    """``--compiled graphs``: the run compiled with ``train.cuda_graphs=true`` (recall's task does not
    declare one batch shape, so the grid's ``auto`` would leave graphs off), labelled in the table."""
    assert recall_step.compile_settings(False) == ["train.compile=false"]
    assert recall_step.compile_settings(True) == ["train.compile=true"]
    assert recall_step.compile_settings("graphs") == ["train.compile=true", "train.cuda_graphs=true"]
    row = dict(length=256, width=512, entry="mha", compiled="graphs", mps=False, processes=8, ms_a_step=8.0,
               card_ms_a_step=1.0, accuracy=0.1)
    assert "| 256 | 512 | mha | graphs | no | 8 | 8.00 | 1.00 | - | - | 0.100 |" in recall_step.table([row], "H200")
    grid, point = recall_step.grid_point("cpu-recall-zoology", 32, 32, "mha")
    from mhe.experiments.grid import run_config

    cfg = run_config(grid, point, recall_step.compile_settings("graphs"))
    assert cfg.train.compile is True and cfg.train.cuda_graphs is True


def test_bad_choices_are_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(recall_step.shutil, "which", lambda name: None)
    for argv, said in ((["--mps", "no,yes"], "--mps yes needs nvidia-cuda-mps-control"),
                       (["--mps", "yes", "--concurrent", "1"], "--mps yes runs only rows of several processes"),
                       (["--mps", "maybe"], "--compiled takes no, yes and graphs, --mps no, yes or no,yes "
                                            "(got 'no,yes', 'maybe')"),
                       (["--compiled", "cudagraphs"], "(got 'cudagraphs', 'no')")):
        with pytest.raises(SystemExit) as done:
            recall_step.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert done.value.code == 2 and said in err[-1] and err[-1].startswith("train_bench.py recall-step: error:")


@pytest.mark.slow
def test_the_cpu_smoke_times_one_and_two_processes(tmp_path):
    out = tmp_path / "rows.json"
    subprocess.run([sys.executable, str(BENCH / "train_bench.py"), "recall-step", "--cpu-smoke", "--json", str(out)],
                   check=True, capture_output=True, timeout=300)
    got = json.loads(out.read_text())
    assert got["card"] == "no GPU (CPU)" and [r["processes"] for r in got["rows"]] == [1, 2]
    for r in got["rows"]:
        assert r["ms_a_step"] > 0 and 0 <= r["accuracy"] <= 1 and "kernels_a_step" not in r  # no --profile
        assert r["entry"] == "mha" and r["grid"] == "cpu-recall-zoology" and r["steps"] == 10


def test_a_run_that_stopped_is_refused_not_read_as_a_step_clock(monkeypatch):
    """A run that did not finish (interrupted by a time limit's signal, or stopped early) returns no
    score: its step clock is refused by name (the tool used to die on a KeyError)."""
    import mhe.tasks.runs

    monkeypatch.setattr(mhe.tasks.runs, "run_training", lambda *a, **k: {"status": "interrupted"})
    grid, point = recall_step.grid_point("cpu-recall-zoology", 32, 32, "mha")
    with pytest.raises(SystemExit, match=r"the run of 7 steps ended 'interrupted', not done"):
        recall_step.train_once(grid, point, 7, False)


def test_concurrent_children_share_the_cores_as_the_pool_does(monkeypatch):
    """N children get the pool's threads each (the cores / N), whatever MHE_THREADS the parent has:
    8 children of 8 threads on 16 cores fought for them and doubled the step (a session's probe)."""
    seen = []

    class Child:
        returncode = 0

        def __init__(self, argv, env, **kw):
            seen.append(env)

        def communicate(self):
            return '{"ms_a_step": 1.0, "accuracy": 0.5}\n', ""

    monkeypatch.setattr(recall_step.subprocess, "Popen", Child)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setenv("MHE_THREADS", "8")
    got = recall_step.run_processes({"grid": "g"}, 8, [], {})
    assert len(got) == 8 and {(e["MHE_THREADS"], e["OMP_NUM_THREADS"]) for e in seen} == {("2", "2")}
    seen.clear()
    recall_step.run_processes({"grid": "g"}, 1, [], {})
    assert seen[0]["MHE_THREADS"] == "8"  # alone: the setting, within the machine's 16


def test_a_profiled_row_names_its_busy_time_kernels_and_top_kernels():
    row = {"gpu_busy_ms_a_step": 2.5, "kernels_a_step": 212.0,
           "top_kernels": [{"name": "sm90_xmma_gemm_bf16", "a_step": 8.0, "us_a_step": 640.4}]}
    assert recall_step.profile_line(row) == ("; GPU busy 2.50 ms, 212 kernels a step; top: sm90_xmma_gemm_bf16 640 us")
    assert recall_step.profile_line({"ms_a_step": 1.0}) == ""


def test_a_step_is_timed_by_the_run_s_steady_intervals_not_its_first():
    """The first log interval holds start-up and compilation (here 50x a step): the time a step is
    the median of the others, in ms; evaluation records without a clock are skipped."""
    records = [{"step": 30, "step_s": 0.5}, {"step": 60, "step_s": 0.012}, {"step": 60, "accuracy": 0.9},
               {"step": 90, "step_s": 0.010}, {"step": 120, "step_s": 0.011}]
    assert recall_step.steady_step_ms(records) == pytest.approx(11.0, rel=1e-12)
    with pytest.raises(SystemExit, match=r"logged 1 interval\(s\) of steps, fewer than the 2"):
        recall_step.steady_step_ms([{"step": 10, "step_s": 0.5}])


def test_rows_finished_before_a_failure_are_kept_in_the_json(tmp_path, monkeypatch, capsys):
    """A call cut short (its second row's children fail, as under a time limit) still leaves the
    first row in ``--json``: rows are written as they finish, not at the end."""
    calls = []

    def children(spec, n, tail, env):
        calls.append(n)
        if len(calls) == 2:
            raise SystemExit("recall-step: a child failed")
        return [{"ms_a_step": 12.0, "accuracy": 0.25}]

    monkeypatch.setattr(recall_step, "run_processes", children)
    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit, match="a child failed"):
        recall_step.main(["--cells", "32:32", "--grid", "cpu-recall-zoology", "--compiled", "no",
                          "--concurrent", "1,2", "--json", str(out)])
    got = json.loads(out.read_text())
    assert calls == [1, 2] and [(r["processes"], r["ms_a_step"]) for r in got["rows"]] == [(1, 12.0)]
