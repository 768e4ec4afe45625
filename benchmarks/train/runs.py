"""The runs of ``train_bench.py``'s ``speed``, ``vs-old`` and ``llama``: each stage a logged subprocess under one deadline,
and the figures read back from its run folder (rates, memory, MFU) for the tables."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from mhe.bench.common import device_peak, flops_per_token
from mhe.models.config import ModelConfig

from toolbox import ROOT, child_env


def first_visible_gpu() -> str:
    """The GPU a one-GPU stage runs on: the first of the caller's ``CUDA_VISIBLE_DEVICES`` (so that
    scripts given other GPUs of one host run side by side), else GPU 0."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"


class Runner:
    """Runs the stages as subprocesses, each logged, none past the deadline."""

    def __init__(self, out: Path, data_dir: str, deadline: float) -> None:
        self.out, self.deadline, self.t0 = out, deadline, time.monotonic()
        self.env = child_env(MHE_DATA=data_dir, PYTHONUNBUFFERED="1")
        self.commands: list[str] = []
        self.skipped: list[str] = []

    def run(self, stage: str, args: list[str], *, gpus: int = 1, src: Path | None = None) -> bool:
        """Run ``mhe ARGS`` as ``stage`` (on ``gpus`` GPUs; with ``src``, that tree's package)."""
        left = self.deadline - (time.monotonic() - self.t0)
        if left < 20:
            self.skipped.append(stage)
            print(f"[{stage}] skipped: the deadline has passed", flush=True)
            return False
        launch = [sys.executable, "-m", "mhe"] if gpus == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m", "mhe"]
        env = dict(self.env, **({"CUDA_VISIBLE_DEVICES": first_visible_gpu()} if gpus == 1 and torch.cuda.is_available()
                                else {}), **({"PYTHONPATH": str(src)} if src else {}))
        shown = ("torchrun --standalone --nproc_per_node " + str(gpus) if gpus > 1 else "") + " mhe " + " ".join(args)
        self.commands.append(f"{stage}: `{shown.strip()}`")
        print(f"[{stage}] {shown.strip()}  ({left:.0f} s left)", flush=True)
        log = self.out / "logs" / f"{stage}.log"
        start = time.monotonic()
        with log.open("w") as f:
            proc = subprocess.Popen(launch + args, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True)  # its own process group: torchrun's workers too
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGTERM)  # the runs save and stop
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                rc = "stopped at the deadline"
        print(f"[{stage}] rc={rc} in {time.monotonic() - start:.0f} s (log {log})", flush=True)
        if rc != 0:
            self.skipped.append(f"{stage} (rc={rc})")
        return rc == 0


def seed_tokenizer(first: Path, run: Path) -> None:
    """Start ``run`` from ``first``'s tokenizer (the task reuses ``tokenizer.json``, as on resume)."""
    if (first / "tokenizer.json").is_file() and not run.exists():
        run.mkdir(parents=True)
        shutil.copy(first / "tokenizer.json", run / "tokenizer.json")


def run_figures(run: Path, after: int, gpus: int) -> dict | None:
    """Median input tokens/s after step ``after`` (all GPUs), per GPU, peak GiB and MFU of a run folder."""
    metrics = run / "metrics.jsonl"
    if not metrics.exists() or not (run / "results.json").exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if "step_s" in r]
    late = [r for r in records if r["step"] > after] or records[-1:]
    config = json.loads((run / "config.json").read_text())
    train, model = config["resolved_train"], ModelConfig(**config["model"])
    seq = config["run"]["data"]["seq_len"] or model.max_len
    tok_s = train["batch_size"] * seq / statistics.median(r["step_s"] for r in late)
    memory = [r["max_mem_gib"] for r in records if "max_mem_gib" in r]
    n_params = json.loads((run / "results.json").read_text())["total_params"]
    peak = device_peak(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    mfu = flops_per_token(n_params, model, seq) * tok_s / gpus / peak if peak else None
    return {"tokens_per_s": tok_s, "per_gpu": tok_s / gpus, "peak_gib": max(memory) if memory else None,
            "mfu": mfu, "steps": records[-1]["step"] if records else 0}


def fmt(v, spec=",.0f", none="-") -> str:
    return none if v is None else format(v, spec)


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def ratio(a, b) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def log_says(out: Path, stage: str, text: str) -> bool:
    """Whether the output of ``stage`` holds ``text`` (a note the run printed, such as a setting
    that could not apply)."""
    log = out / "logs" / f"{stage}.log"
    return log.is_file() and text in log.read_text(errors="replace")
