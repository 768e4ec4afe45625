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
    line.finish(a)  # a finished run: 0.1 s a step, its start-up included
    line.start(b)
    now[0] = 12.0  # b has spent 2 of its 10 s
    assert line.line() == "compare: 1/2 runs done | sha seed 0 step 0/100 | 50% of 200 steps, ETA 8s"
    assert duration(3725) == "1h 02m" and duration(185) == "3m 05s"
    (a.run_dir / "metrics.jsonl").write_text('{"step": 8, "loss": 1}\n{"step": 9, "lo')  # a torn last record
    assert last_step(a.run_dir) == 8 and last_step(tmp_path / "missing") == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_the_eta_after_a_finished_run_is_within_half_again_of_the_truth(tmp_path, workers):
    """Issue 58: runs that spend 30 s starting and then log every 10th of 100 steps at 1 s each, six
    of them on ``workers`` at once; from the first finished run on, the ETA is never more than 1.5
    times the time truly left (nor less than half of it)."""
    now, start_up, steps = [0.0], 30.0, 100
    jobs = [Job(f"run {i}", tmp_path / f"r{i}", steps) for i in range(6)]
    line = SweepProgress(jobs, enabled=False, clock=lambda: now[0])
    took = start_up + steps
    waves = [jobs[i:i + workers] for i in range(0, len(jobs), workers)]
    end = took * len(waves)
    checked = 0
    for w, wave in enumerate(waves):
        t0 = w * took
        for t in range(int(t0), int(t0 + took)):
            now[0] = float(t)
            for job in wave:
                if t == t0:
                    line.start(job)
                logged = max(0, int(t - t0 - start_up)) // 10 * 10
                _metrics(job.run_dir, *range(10, logged + 1, 10))
            if w > 0 and t % 5 == 0:
                eta = line.line().rsplit("ETA ", 1)[1]
                m, _, sec = eta.partition("m ")
                seconds = int(m) * 60 + int(sec.rstrip("s")) if sec else int(eta.rstrip("s"))
                assert 0.5 * (end - t) <= seconds <= 1.5 * (end - t), (t, eta)
                checked += 1
        now[0] = t0 + took
        for job in wave:
            line.finish(job)
    assert checked > 20


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
        log = (out / "runs" / f"{kind}-seed0" / "stderr.log").read_text()
        assert "training: 8/8 steps in" in log and "\r" not in log  # the run's own progress, as whole lines


def test_runs_in_this_process_draw_the_line_instead_of_their_own_bars(tmp_path, capsys):
    from mhe.experiments.sweep import Sweep, run_sweep

    log = []
    run_sweep(Sweep("recall", "tiny-decoder", ["sha"], 1, overrides=list(SMALL)), tmp_path / "cmp", workers=1,
              log=log.append, progress=True)
    err = capsys.readouterr().err
    assert "compare: 0/1 runs done | sha seed 0 step" in err and "[done] sha seed 0" in err
    assert "step/s" not in err  # the run's own bar is off while the line is drawn
