"""The GPU record's reading of pytest logs (``benchmarks/gpu_tests_record.py``): a finished run's
summary, and a run a time limit killed, whose last progress line shares a line with the exit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_tests_record  # noqa: E402


def test_a_finished_run_gives_its_summary_and_exit(tmp_path):
    log = tmp_path / "one.log"
    log.write_text("+ python -m pytest -m gpu\n..s. [100%]\nSKIPPED [1] tests/t.py:3: needs two CUDA devices\n"
                   "3 passed, 1 skipped in 2.00s\nexit 0 after 5 s\n")
    out = "\n".join(gpu_tests_record.section(log, "One GPU"))
    assert "Summary: `3 passed, 1 skipped in 2.00s` (exit 0 after 5 s)" in out
    assert "* `SKIPPED [1] tests/t.py:3: needs two CUDA devices`" in out


def test_a_killed_run_counts_its_progress_marks_also_on_the_line_it_shares_with_the_exit(tmp_path):
    log = tmp_path / "two.log"
    log.write_text("+ python -m pytest -m gpu\n" + "." * 70 + "s. [ 65%]\n" + "." * 25 + "F" + "exit 124 after 525 s\n")
    out = "\n".join(gpu_tests_record.section(log, "Two GPUs"))
    assert "progress marks before it ended: 96 passed, 1 failed, 1 skipped` (exit 124 after 525 s)" in out


def test_the_plan_spreads_one_card_tests_over_every_card_and_pairs_the_two_card_tests():
    assert gpu_tests_record.plan(4, 2) == [
        (gpu_tests_record.LOGS[0], "gpu and not two_gpus", 8, "0;1;2;3"),
        (gpu_tests_record.LOGS[1], "gpu and two_gpus", 2, "0,1;2,3")]
    assert gpu_tests_record.plan(1, 3) == [(gpu_tests_record.LOGS[0], "gpu and not two_gpus", 3, "0")]


def test_each_xdist_worker_sees_its_own_card(monkeypatch):
    """``tests/conftest.py`` pins worker gwK to set K mod len of ``MHE_GPU_SETS``; outside a
    record (no sets, or no xdist worker) it leaves the visible cards alone."""
    import conftest

    for worker, want in (("gw0", "0,1"), ("gw1", "2,3"), ("gw2", "0,1")):
        monkeypatch.setenv("MHE_GPU_SETS", "0,1;2,3")
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "untouched")
        conftest._pin_gpus()
        assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == want
    monkeypatch.delenv("MHE_GPU_SETS")
    conftest._pin_gpus()
    assert __import__("os").environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # as the last pinning left it


def test_a_run_past_its_deadline_is_ended_and_its_log_says_so(tmp_path):
    import subprocess
    import time

    log = tmp_path / "slow.log"
    log.write_text("+ sleep\n")
    fast = tmp_path / "fast.log"
    fast.write_text("+ true\n")
    now = time.monotonic()
    runs = [(log, subprocess.Popen(["sleep", "60"], start_new_session=True), now),
            (fast, subprocess.Popen(["true"], start_new_session=True), now)]
    gpu_tests_record.wait_all(runs, deadline=1)
    assert "exit 124 after" in log.read_text() and not gpu_tests_record.passed(log)
    assert gpu_tests_record.passed(fast)
    assert time.monotonic() - now < 30


def test_adopt_refuses_a_run_of_other_src_files(tmp_path, capsys):
    (tmp_path / "env.txt").write_text("torch x\nsrc sha256 (sorted .py files): 0000\n")
    (tmp_path / "gpu-tests.md").write_text("# GPU tests on the device for main's src tree\n\n")
    assert gpu_tests_record.main(["adopt", str(tmp_path), "--out", str(tmp_path / "out.md")]) == 2
    assert "0000" in capsys.readouterr().err and not (tmp_path / "out.md").exists()


def test_a_one_card_host_says_the_two_card_tests_did_not_run():
    one, four = gpu_tests_record.how_shared(1, 6, 146), gpu_tests_record.how_shared(4, 2, 156)
    assert "did not run" in one and "146 s" in one
    assert "two-card tests one worker a pair" in four and "did not run" not in four


def test_a_record_runs_with_ci_set_so_missing_data_fails_rather_than_skips(tmp_path, monkeypatch):
    seen = {}

    class Popen:
        def __init__(self, command, env, **_):
            seen.update(env=env, command=command)
    monkeypatch.setattr(gpu_tests_record.subprocess, "Popen", Popen)
    gpu_tests_record.start(tmp_path / "one.log", "gpu and not two_gpus", 2, "0;1")
    assert seen["env"]["CI"] == "true" and seen["env"]["MHE_GPU_SETS"] == "0;1"
    assert (tmp_path / "one.log").read_text().startswith("+ CI=true MHE_GPU_SETS='0;1' python -m pytest")
