"""``mhe compare`` shows one live line for the whole comparison on a terminal (issue 45): runs
done, each running run's step and an ETA; each worker's own progress bar stays in its
``stderr.log``."""

import json
import sys

import pytest

from mhe.cli import main
from mhe.experiments.sweep_progress import Job, SweepProgress, duration, last_step
from test_compare import SMALL


def _metrics(run_dir, *steps):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in steps))


def test_the_line_counts_runs_steps_and_the_eta(tmp_path):
    now = [0.0]
    a, b = Job("mha seed 0", tmp_path / "a", 100), Job("sha seed 0", tmp_path / "b", 100)
    line = SweepProgress([a, b], enabled=False, clock=lambda: now[0])
    line.start(a)
    assert line.line() == "compare: 0/2 runs done | mha seed 0 step 0/100 | 0% of 200 steps, ETA --"
    _metrics(a.run_dir, 25, 50)
    now[0] = 10.0  # 50 steps in 10 s: 150 to go at 5 per second
    assert line.line() == "compare: 0/2 runs done | mha seed 0 step 50/100 | 25% of 200 steps, ETA 30s"
    line.finish(a)
    line.start(b)
    now[0] = 20.0  # 100 steps in 20 s: 100 to go
    assert line.line() == "compare: 1/2 runs done | sha seed 0 step 0/100 | 50% of 200 steps, ETA 20s"
    assert duration(3725) == "1h 02m" and duration(185) == "3m 05s"
    (a.run_dir / "metrics.jsonl").write_text('{"step": 8, "loss": 1}\n{"step": 9, "lo')  # a torn last record
    assert last_step(a.run_dir) == 8 and last_step(tmp_path / "missing") == 0


@pytest.mark.slow  # two worker processes: about 12 s on 2 cores
def test_compare_draws_the_line_on_a_terminal_and_keeps_each_runs_bar_in_its_log(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    out = tmp_path / "cmp"
    argv = ["compare", "--task", "recall", "--preset", "tiny-decoder", "--kinds", "sha,mha", "--seeds", "1",
            "--workers", "2", "--out", str(out)]
    for item in SMALL:
        argv += ["--set", item]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "\r\x1b[Kcompare: 0/2 runs done" in err and "of 16 steps, ETA" in err
    assert "compare: 2/2 runs done" in err and "[done] sha seed 0" in err
    for kind in ("sha", "mha"):
        assert "| 0/8 [" in (out / "runs" / f"{kind}-seed0" / "stderr.log").read_text()  # the run's own bar


def test_runs_in_this_process_draw_the_line_instead_of_their_own_bars(tmp_path, capsys):
    from mhe.experiments.sweep import Sweep, run_sweep

    log = []
    run_sweep(Sweep("recall", "tiny-decoder", ["sha"], 1, overrides=list(SMALL)), tmp_path / "cmp", workers=1,
              log=log.append, progress=True)
    err = capsys.readouterr().err
    assert "compare: 0/1 runs done | sha seed 0 step" in err and "[done] sha seed 0" in err
    assert "step/s" not in err  # the run's own bar is off while the line is drawn
