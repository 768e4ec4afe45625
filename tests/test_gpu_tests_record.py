"""The GPU record's reading of pytest logs (``benchmarks/gpu_tests_record.py``): a finished run's
summary, and a run a time limit killed, whose last progress line shares a line with the exit."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
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
