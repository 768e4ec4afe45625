"""Many small runs in a few long-lived processes: a pool of workers, each one Python process that
imports torch once and trains the runs handed to it one after another, in place of one process
per run. For studies of hundreds of tiny runs (recall at Zoology's scale), where starting a
process (importing torch, a CUDA context) would take longer than many of the runs themselves.

The parent (:class:`Pool`) starts ``workers`` processes (``python -m mhe.experiments.pool``),
GPUs round-robin over them (several workers share a card), and feeds each one run at a time
over its standard input: the run's ``run.json`` and folder, one JSON line; the worker answers
with one line holding the exit status (0 finished, 143 or 130 interrupted by a signal after
saving, 1 failed). A run's console goes to ``stderr.log`` in its folder, as a run of
``mhe compare --workers`` does. Jobs come from a :class:`Queue` that may grow while runs finish
(a study's second phase depends on its first). SIGTERM or SIGINT to the parent stops handing out
runs and reaches the workers, whose running runs save and stop; a later call resumes them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mhe.runtime import worker_threads


@dataclass
class PoolJob:
    name: str          # how the console names it
    run_dir: Path      # its folder; run.json written there before it is handed out
    config: object     # its RunConfig
    data: dict | None = None  # the caller's (which group the run belongs to)


class Queue:
    """Jobs waiting, with the number running: :meth:`take` waits while runs still going may add
    jobs (``on_done``, put ahead of those waiting), and returns None once nothing waits and
    nothing runs, or after :meth:`stop`. With ``admit``, a job is handed out only if
    ``admit(job)`` holds when a worker asks (a run expected to outlast the call stays waiting, for
    the next call): a worker that finds none it may take waits while runs still going may add
    one, and what is never admitted is left in ``pending``. ``admit`` and ``on_done`` are called
    under the queue's lock, so state they share needs no lock of its own."""

    def __init__(self, jobs: list[PoolJob], on_done: Callable[[PoolJob, int], list[PoolJob]] | None = None,
                 admit: Callable[[PoolJob], bool] | None = None):
        self.pending, self.running, self.stopped = list(jobs), 0, False
        self.on_done = on_done or (lambda job, rc: [])
        self.admit = admit or (lambda job: True)
        self.cond = threading.Condition()
        self.failed: list[PoolJob] = []

    def take(self) -> PoolJob | None:
        with self.cond:  # admission only loosens in done(), which notifies: waiting needs no timeout
            while not self.stopped:
                for i, job in enumerate(self.pending):
                    if self.admit(job):
                        self.running += 1
                        return self.pending.pop(i)
                if not self.running:
                    return None
                self.cond.wait()
            return None

    def done(self, job: PoolJob, rc: int) -> None:
        with self.cond:
            self.running -= 1
            if rc == 0:  # what a finished run makes possible goes first: groups finish whole
                self.pending[:0] = self.on_done(job, rc)
            elif rc not in (130, 143):
                self.failed.append(job)
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify_all()


def gpu_of(slot: int, gpus: int, visible: str | None) -> str:
    """Worker ``slot``'s ``CUDA_VISIBLE_DEVICES``: the GPUs round-robin (the parent's own entries
    where it restricts them)."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if len(entries) >= gpus > 0:
        return entries[slot % gpus]
    return str(slot % gpus)


class Pool:
    """``workers`` long-lived worker processes fed from one :class:`Queue`."""

    def __init__(self, workers: int, *, gpus: int = 0, log=print):
        self.workers, self.gpus, self._log = workers, gpus, log
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()
        self.log_lock = threading.Lock()

    def log(self, line: str) -> None:
        """One console line, whole: the worker threads log at once, and ``print`` writes a line's
        text and its newline apart (two lines could otherwise run together)."""
        with self.log_lock:
            self._log(line)

    def run(self, queue: Queue, write_config: Callable[[PoolJob], None]) -> None:
        """Run every job of ``queue`` (and those it adds); returns when all are done or a signal
        stopped them (the signal then re-raised as KeyboardInterrupt with its exit code)."""
        caught: list[int] = []

        def on_signal(signum, frame):
            caught.append(signum)
            queue.stop()
            with self.lock:
                for p in self.procs:  # a signal sent to the parent alone reaches the runs too
                    with contextlib.suppress(ProcessLookupError):
                        p.send_signal(signum)

        main = threading.current_thread() is threading.main_thread()
        old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)} if main else {}
        try:
            threads = [threading.Thread(target=self._slot, args=(i, queue, write_config), daemon=True)
                       for i in range(self.workers)]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(0.2)
        finally:
            for s, h in old.items():
                signal.signal(s, h)
        if caught:
            e = KeyboardInterrupt()
            e.exit_code = 128 + caught[0]
            raise e

    def _start(self, slot: int) -> subprocess.Popen:
        threads = worker_threads(self.workers)
        env = dict(os.environ, MHE_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = gpu_of(slot, self.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
        p = subprocess.Popen([sys.executable, "-m", "mhe.experiments.pool"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, env=env, text=True, bufsize=1)
        with self.lock:
            self.procs.append(p)
        return p

    def _slot(self, slot: int, queue: Queue, write_config) -> None:
        proc = None
        try:
            while (job := queue.take()) is not None:
                if proc is None or proc.poll() is not None:
                    proc = self._start(slot)
                write_config(job)
                resume = (job.run_dir / "config.json").is_file()
                gpu = f" on GPU {gpu_of(slot, self.gpus, os.environ.get('CUDA_VISIBLE_DEVICES'))}" if self.gpus else ""
                self.log(f"[{'resume' if resume else 'start'}] {job.name}{gpu}")
                rc = self._ask(proc, job, resume)
                queue.done(job, rc)
                self._say(job, rc)
        finally:
            if proc is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
                proc.wait()

    @staticmethod
    def _ask(proc: subprocess.Popen, job: PoolJob, resume: bool) -> int:
        try:
            proc.stdin.write(json.dumps({"config": str(job.run_dir / "run.json"), "out": str(job.run_dir),
                                         "resume": resume}) + "\n")
            proc.stdin.flush()
            line = proc.stdout.readline()
        except OSError:
            line = ""
        if not line:  # the worker died (killed, or a crash outside the run)
            code = proc.wait()
            return 128 - code if code < 0 else (code or 1)  # killed by a signal: 128 + its number
        return int(json.loads(line)["rc"])

    def _say(self, job: PoolJob, rc: int) -> None:
        res = job.run_dir / "results.json"
        if rc == 0 and res.is_file():
            self.log(f"[done] {job.name}: {json.loads(res.read_text())['score']:.4g}")
        elif rc in (130, 143):
            self.log(f"[stopped] {job.name} (saved; the same command with --resume continues it)")
        else:
            self.log(f"[failed] {job.name} (exit {rc}); see {job.run_dir / 'stderr.log'}")


def _one(request: dict) -> int:
    """Train one run in this process, its console in its ``stderr.log``; its exit status."""
    from mhe.tasks.catalogue import read_run_config_file
    from mhe.tasks.runs import exit_status, run_training
    from mhe.training.loop import DONE

    out = Path(request["out"])
    with open(out / "stderr.log", "a") as err, contextlib.redirect_stderr(err):
        try:
            cfg = read_run_config_file(request["config"])
            res = run_training(cfg, out, bool(request["resume"]), log=lambda m: print(m, file=err, flush=True))
        except KeyboardInterrupt:
            return 130
        except Exception as e:  # noqa: BLE001 (one run's failure is reported, the worker goes on)
            import traceback
            traceback.print_exc(file=err)
            print(f"error: {e}", file=err)
            return 1
    return 0 if res["status"] in DONE else (exit_status(res) or 3)


def main() -> int:
    """The worker: one JSON request a line on standard input, one answer a line on standard
    output, until the input ends or a run was interrupted by a signal."""
    for line in sys.stdin:
        rc = _one(json.loads(line))
        print(json.dumps({"rc": rc}), flush=True)
        if rc in (130, 143):
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
