"""One live line on the terminal for a whole comparison (``mhe compare``): how many runs are done,
the step each running run has reached and an ETA, redrawn about once a second on standard error.

The runs themselves keep their own progress in their logs (``runs/KIND-seedN/stderr.log`` for
the worker processes; whole lines there, :func:`mhe.progress.counter`). The line reads the step each run last logged in its
``metrics.jsonl`` (one record per ``train.log_every`` steps), so it works the same for runs in
this process and in workers. Until a run finishes the ETA divides the steps still to do by the
rate since the line started; from then on each step to do takes what a finished run's step took,
its start-up included (:meth:`SweepProgress._seconds_left`). Messages (``[start]``, ``[done]``)
are printed above it. Off a terminal it draws nothing.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple, TextIO

from mhe.training.run_files import METRICS


class Job(NamedTuple):
    """One run of the comparison: its label, its folder and its step count (0: not known ahead)."""

    label: str
    run_dir: Path
    steps: int


def last_step(run_dir: Path) -> int:
    """The step of the last whole record in ``run_dir/metrics.jsonl`` (0 when there is none)."""
    path = run_dir / METRICS
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return 0
    for line in reversed(tail.split("\n")[:-1]):  # the part after the last newline may be torn
        key = line.find('"step": ')
        if key >= 0:
            digits = line[key + 8:].split(",", 1)[0].split("}", 1)[0].strip()
            if digits.isdigit():
                return int(digits)
    return 0


def duration(seconds: float) -> str:
    """``1h 02m``, ``3m 05s`` or ``42s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 60}m {s % 60:02d}s" if s >= 60 else f"{s}s"


class SweepProgress:
    """The comparison's line: ``start(job)`` / ``finish(job)`` as runs begin and end, ``log(msg)``
    for a message above the line; use it as a context manager (draws from a thread while open)."""

    def __init__(self, jobs: list[Job], *, enabled: bool, stream: TextIO | None = None, interval: float = 1.0,
                 clock=time.monotonic) -> None:
        self.jobs, self.enabled, self.interval, self.clock = list(jobs), enabled, interval, clock
        self.stream = stream or sys.stderr
        self.running: list[Job] = []
        self.done: list[Job] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = clock()
        self._steps0: int | None = None  # steps already done (resumed runs) when the line started
        self._began: dict[Path, tuple[float, int]] = {}  # a running run's folder -> (when it started, its step then)
        self._per_step: list[float] = []  # each finished run's seconds per step, its start-up included

    def steps_done(self) -> int:
        return sum(j.steps for j in self.done) + sum(min(last_step(j.run_dir), j.steps or 10 ** 12)
                                                    for j in self.running)

    def line(self) -> str:
        """The text of the line now."""
        with self._lock:
            running, n_done = list(self.running), len(self.done)
        parts = [f"compare: {n_done}/{len(self.jobs)} runs done"]
        parts += [f"{j.label} step {last_step(j.run_dir)}" + (f"/{j.steps}" if j.steps else "") for j in running]
        total = sum(j.steps for j in self.jobs)
        if total and all(j.steps for j in self.jobs):
            done = self.steps_done()
            if self._steps0 is None:
                self._steps0 = done
            left = self._seconds_left(running)
            if left is None:  # no run finished yet: the steps to do at the rate since the line started
                rate = (done - self._steps0) / max(self.clock() - self._t0, 1e-9)
                left = (total - done) / rate if rate > 0 else None
            eta = duration(left) if left is not None else "--"
            parts.append(f"{100 * done // total}% of {total:,} steps, ETA {eta}")
        return " | ".join(parts)

    def _seconds_left(self, running: list[Job]) -> float | None:
        """Once a run has finished: every step still to do takes what a finished run's step took,
        its start-up (data, model, compilation) included, shared among the runs going at once; a
        running run has already spent its time since it started. None before any run finished.
        (The rate of logged steps since the line started leaves out the start-ups still to come and
        counts a run's steps only as it logs them.)"""
        with self._lock:
            if not self._per_step:
                return None
            per_step = sum(self._per_step) / len(self._per_step)
            began, done = dict(self._began), list(self.done)
        now = self.clock()
        queued = sum(j.steps for j in self.jobs if j not in running and j not in done) * per_step
        going = sum(max(0.0, (j.steps - began[j.run_dir][1]) * per_step - (now - began[j.run_dir][0]))
                    for j in running if j.run_dir in began)
        return (queued + going) / max(1, len(running))

    def _draw(self, text: str) -> None:
        width = shutil.get_terminal_size((100, 20)).columns - 1
        with self._lock:
            self.stream.write("\r\x1b[K" + text[:width])
            self.stream.flush()

    def log(self, message: str) -> None:
        """``message`` on its own line above the live line (the plain line when not drawing)."""
        if not self.enabled:
            print(message, file=self.stream, flush=True)
            return
        with self._lock:
            self.stream.write("\r\x1b[K" + message + "\n")
        self._draw(self.line())

    def start(self, job: Job) -> None:
        step = last_step(job.run_dir)  # a resumed run starts where it stopped
        with self._lock:
            self.running.append(job)
            self._began[job.run_dir] = (self.clock(), step)

    def finish(self, job: Job) -> None:
        with self._lock:
            self.running = [j for j in self.running if j != job]
            self.done.append(job)
            began = self._began.pop(job.run_dir, None)
            if began is not None and job.steps > began[1]:  # a run that trained here: its seconds per step
                self._per_step.append((self.clock() - began[0]) / (job.steps - began[1]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw(self.line())

    def __enter__(self) -> "SweepProgress":
        if self.enabled:
            self._t0 = self.clock()
            self._draw(self.line())
            self._thread = threading.Thread(target=self._loop, name="compare-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.stream.write("\r\x1b[K")
            self.stream.flush()
