"""The runs of the uptraining study (``benchmarks/uptrain.py study``): each one an ``mhe pretrain``
command, run as a process beside others on the one GPU (:class:`Pool`) or one after another in
the study's own process (:class:`InlinePool`)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolbox import ROOT, child_env


@dataclass
class Job:
    """One ``mhe pretrain`` process: ``name`` (its folder under runs/), ``args``, ``steps``."""

    name: str
    args: list
    steps: int
    kind: str
    role: str  # pretrain | scratch | uptrain
    fraction: float = 0.0
    seed: int = 0
    start: float = 0.0
    end: float = 0.0
    rc: int | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)


# ------------------------------------------------------------------ commands
def common_sets(args, kind: str = "", *, model: bool = True) -> list[str]:
    """``--set`` items every run shares (``model``: also the model and tokenizer settings, which
    an uptraining run takes from the converted folder instead)."""
    items = [f"train.batch_size={args.batch_size}", f"train.lr={args.lr}", "train.schedule=cosine",
             "train.eval_every=0", "train.save_every=0", "train.keep_last=1", "train.progress=false",
             f"train.log_every={5 if args.cpu_smoke else 50}"]
    if model:
        items += [*args.model_set, "data.tokenizer=bpe", f"data.vocab_size={args.vocab_size}"]
        if kind == "gqa" and args.n_kv_heads:
            items.append(f"model.attn_options.n_kv_heads={args.n_kv_heads}")
    if args.limit_lines:
        items.append(f"data.limit_lines={args.limit_lines}")
    if args.also_test:  # further test sets every run is scored on (results.json: CORPUS_word_perplexity)
        items.append(f"data.task_options.also_test={json.dumps(args.also_test.split(','))}")
    items.append(f"train.compile={'true' if args.compile else 'false'}")  # eager unless asked (RUN.md says why)
    if args.cpu_smoke:  # one sliding window at the score's stride (half the window), not a second one at 256
        items += ["train.device=cpu", "data.eval_stride=16"]
    return items


def sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def train_job(args, runs: Path, kind: str, steps: int, role: str) -> Job:
    """Pre-training (MHA, N steps) or a kind from scratch (N + the longest uptraining): the
    same schedule, cosine after a warm-up of 5% of the steps."""
    name = "pretrain-mha" if role == "pretrain" else f"scratch-{kind}"
    cmd = ["pretrain", "--preset", args.preset, "--attention", kind, "--data", args.data,
           "--data-dir", args.data_dir, "--out", str(runs / name),
           *sets([*common_sets(args, kind), f"train.steps={steps}", "train.warmup_ratio=0.05"])]
    return Job(name, cmd, steps, kind, role)


def uptrain_job(args, runs: Path, kind: str, fraction: float, seed: int) -> Job:
    """The documented recipe: ``mhe pretrain --init-from CONVERTED --set train.steps=F*N`` (the
    converted run's model and tokenizer, its default warm-up of 5% of the steps)."""
    steps = max(1, round(fraction * args.steps))
    name = f"uptrain-{kind}-{fraction_label(fraction)}-seed{seed}"
    cmd = ["pretrain", "--init-from", str(runs / f"convert-{kind}"), "--data", args.data,
           "--data-dir", args.data_dir, "--out", str(runs / name), "--seed", str(seed),
           *sets([*common_sets(args, model=False), f"train.steps={steps}"])]
    return Job(name, cmd, steps, kind, "uptrain", fraction, seed)


def fraction_label(f: float) -> str:
    return f"{100 * f:g}pct"


# ------------------------------------------------------------------ processes on the one GPU
JOB_TIMES = "study-job.json"
"""A finished job's wall time, written beside its run (what ``--resume`` keeps it by)."""


def kept(job: Job, folder: Path, log) -> bool:
    """Whether ``job`` finished in an earlier call of the study into the same folder (its run's
    results.json and its time are there): it is then kept as done, not run again. A run that was
    started and stopped (its config.json there) continues from its checkpoint (``--resume``)."""
    if (folder / "results.json").is_file() and (folder / JOB_TIMES).is_file():
        job.start, job.end, job.rc = 0.0, json.loads((folder / JOB_TIMES).read_text())["seconds"], 0
        log(f"[kept] {job.name}: finished in an earlier call ({job.end:.0f} s)")
        return True
    if (folder / "config.json").is_file() and "--resume" not in job.args:
        job.args = [*job.args, "--resume"]
        log(f"[resume] {job.name}: continues the run in its folder")
    return False

class Pool:
    """At most ``workers`` ``mhe`` processes at a time; each writes its console to its run folder."""

    def __init__(self, workers: int, runs: Path, log) -> None:
        self.workers, self.runs, self.log = workers, runs, log
        self.running: list[Job] = []
        from mhe.runtime import worker_threads

        threads = worker_threads(workers)
        self.env = child_env(MHE_THREADS=str(threads), OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")

    def free(self) -> int:
        return self.workers - len(self.running)

    def start(self, job: Job) -> None:
        folder = self.runs / job.name
        folder.mkdir(parents=True, exist_ok=True)
        if kept(job, folder, self.log):
            return
        job.start = time.time()
        with open(folder / "console.log", "ab") as console:
            job.proc = subprocess.Popen([sys.executable, "-m", "mhe", *job.args], env=self.env, cwd=ROOT,
                                        stdout=console, stderr=subprocess.STDOUT)
        self.running.append(job)
        self.log(f"[start] {job.name} ({job.steps} steps)")

    def poll(self) -> list[Job]:
        done = [j for j in self.running if j.proc.poll() is not None]
        for j in done:
            j.rc, j.end = j.proc.returncode, time.time()
            self.running.remove(j)
            if j.rc == 0:
                from mhe.training.atomic import write_json_atomic

                write_json_atomic(self.runs / j.name / JOB_TIMES, {"seconds": j.end - j.start})
            self.log(f"[{'done' if j.rc == 0 else f'exit {j.rc}'}] {j.name} ({j.end - j.start:.0f} s)")
        return done

    def stop_all(self, why: str) -> list[Job]:
        """SIGTERM every running job (each saves a checkpoint and exits) and wait for them."""
        for j in self.running:
            self.log(f"[stop] {j.name}: {why}")
            j.proc.terminate()
        stopped = list(self.running)
        for j in stopped:
            try:
                j.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                j.proc.kill()
        self.poll()
        return stopped


class InlinePool(Pool):
    """The same interface, each job run to its end in this process when started (``--inline``,
    the default of ``--cpu-smoke``: one interpreter start instead of one per run, which is most
    of a tiny run's time); its console goes to the run folder as a process's would."""

    def __init__(self, runs: Path, log) -> None:
        self.workers, self.runs, self.log, self.running, self.done = 1, runs, log, [], []

    def start(self, job: Job) -> None:
        import contextlib
        import traceback

        from mhe.cli import main as mhe_main

        folder = self.runs / job.name
        folder.mkdir(parents=True, exist_ok=True)
        if kept(job, folder, self.log):
            self.done.append(job)
            return
        self.log(f"[start] {job.name} ({job.steps} steps, in this process)")
        job.start = time.time()
        with open(folder / "console.log", "a") as console, contextlib.redirect_stdout(console), \
                contextlib.redirect_stderr(console):
            try:
                job.rc = mhe_main(list(job.args))
            except Exception:  # noqa: BLE001 - the run failed as a process would: its traceback in its console
                traceback.print_exc()
                job.rc = 1
        job.end = time.time()
        self.log(f"[{'done' if job.rc == 0 else f'exit {job.rc}'}] {job.name} ({job.end - job.start:.0f} s)")
        if job.rc == 0:
            from mhe.training.atomic import write_json_atomic

            write_json_atomic(folder / JOB_TIMES, {"seconds": job.end - job.start})
        self.done.append(job)

    def poll(self) -> list[Job]:
        done, self.done = self.done, []
        return done

    def stop_all(self, why: str) -> list[Job]:
        return []
