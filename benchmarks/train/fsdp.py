"""DDP against FSDP on the GPUs of one host, and a model that only FSDP can train, through `mhe`'s trainer.

    python benchmarks/train_bench.py fsdp OUT [--gpus 2|4] [--gpt2] [--data wikitext-2 --data-dir DIR]
                                        [--deadline SECONDS] [--ddp-oom] [--only STAGE,...] [--cpu-smoke]

Runs, each under ``torchrun --standalone --nproc_per_node GPUS`` with the trainer's defaults
(compiled, bf16; under FSDP bf16 gathers with float32 gradient reduction, each block compiled):

* ``base-K-ddp`` and ``base-K-fsdp`` for K = mha, mhe-mul: ``llama-1.1b`` (``--gpt2``: a GPT-2-shaped
  1.2B, ``gpt2-medium`` widened to 2048 x 22 layers) at 4 x 2048 tokens per GPU, 24 steps;
* ``big-mha-fsdp``: a Llama-2-shaped model of the same family that does not fit on one card
  under DDP: 4096 x 32 layers (6.7B parameters) on cards under 100 GiB, 5120 x 40 (13.0B) on
  larger ones, under FSDP with ``train.activation_checkpointing=full``, 2 x 2048 tokens per GPU,
  12 steps. DDP would hold 16 bytes per parameter before activations (weights, gradients and
  AdamW's two moments in float32); the table states that bound against the card's memory. With
  ``--ddp-oom`` the script also tries it (``big-mha-ddp``) and reports the out-of-memory error
  it measures.

Figures: tokens/s are the median logged step times after the first third of the steps (which
holds the compilation), as input tokens per second over all GPUs and per GPU; peak GiB is rank
0's ``torch.cuda.max_memory_allocated``. Runs are short (random tokens, no evaluation, no
checkpoint) and start in the order above; once ``--deadline`` seconds (default 400) have passed
the rest are skipped and a running one stopped, and the table says so (``--only`` runs the named
stages, e.g. the ones skipped, into another OUT). About 6 to 7 minutes on two H100s, compilation
included.

Out: ``OUT/fsdp-speed.md`` (cards, torch, commands, table), ``OUT/logs/STAGE.log`` and
``OUT/runs/STAGE/`` (config and metrics). Data: random tokens, or ``--data NAME`` read from
``--data-dir`` as ``mhe pretrain`` reads it (its tokenizer is trained first). ``--cpu-smoke``
runs the same logic with two gloo processes on the CPU, tiny presets and a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from toolbox import BENCHMARKS, ROOT, child_env

import torch

from mhe.accounting.params import decoder_params
from mhe.bench.common import device_peak, flops_per_token
from mhe.models.config import preset as model_preset

GIB = 2 ** 30
SEQ = 2048
BIG = {"llama": [dict(d_model=4096, n_layers=32, n_heads=32, d_ff=11008),     # Llama-2-7B's shape
                 dict(d_model=5120, n_layers=40, n_heads=40, d_ff=13824)],    # Llama-2-13B's shape
       "gpt2": [dict(d_model=4096, n_layers=32, n_heads=32, d_ff=16384),
                dict(d_model=5120, n_layers=40, n_heads=40, d_ff=20480)]}
KINDS = ("mha", "gqa", "mhe-mul")  # gqa: the preset's own grouping (llama-1.1b: 4 K/V heads)
GPT2_1B = dict(d_model=2048, n_layers=22, n_heads=16, d_ff=8192, max_len=SEQ)


def stages(a, card_gib: float | None) -> list[dict]:
    """What to run: name, preset, kind, model overrides, parallel mode, checkpointing, batch per GPU, steps."""
    family = "gpt2" if a.gpt2 else "llama"
    if a.cpu_smoke:
        small, seq, steps = ("tiny-decoder" if a.gpt2 else "llama-tiny"), 64, 6
        one = dict(preset=small, model={}, seq=seq, steps=steps, per_gpu=4)
        big = dict(preset=small, model={"n_layers": 4}, seq=seq, steps=steps, per_gpu=2)
    else:
        one = dict(preset="gpt2-medium" if a.gpt2 else "llama-1.1b", model=GPT2_1B if a.gpt2 else {}, seq=SEQ,
                   steps=a.steps, per_gpu=4)
        big = dict(preset=one["preset"], model={**pick_big(family, one["preset"], card_gib, a.gpus), "max_len": SEQ},
                   seq=SEQ, steps=12, per_gpu=2)
    out = [dict(one, name=f"base-{k}-{p}", kind=k, parallel=p, ac="none") for k in KINDS for p in ("ddp", "fsdp")]
    out.append(dict(big, name="big-mha-fsdp", kind="mha", parallel="fsdp", ac="full"))
    if a.ddp_oom:
        out.append(dict(big, name="big-mha-ddp", kind="mha", parallel="ddp", ac="full"))
    return out


def n_params(preset: str, kind: str, model: dict) -> int:
    return decoder_params(model_preset(preset).replace(attention=kind, **model))["total"]


def pick_big(family: str, preset: str, card_gib: float | None, gpus: int) -> dict:
    """The first shape whose DDP state (16 bytes/parameter) exceeds the card by 15% and whose
    FSDP share (16/N bytes/parameter) leaves a quarter of the card for activations."""
    for shape in BIG[family]:
        state = 16 * n_params(preset, "mha", shape) / GIB
        if card_gib is None or (state > 1.15 * card_gib and state / gpus < 0.75 * card_gib):
            return shape
    return BIG[family][-1]


def worker(spec: dict) -> None:
    """One run under torchrun: the trainer on random tokens (or a corpus), no evaluation."""
    from mhe.bench.training import RandomLM
    from mhe.tasks import build_run, build_task
    from mhe.training.loop import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world) if torch.cuda.is_available() else 1)  # init
    items = [f"train.steps={spec['steps']}", f"train.batch_size={spec['per_gpu'] * world}", "train.log_every=2",
             "train.save_every=0", "train.eval_every=0", "train.keep_checkpoints=false", "train.progress=false",
             "train.warmup_steps=0", f"data.seq_len={spec['seq']}", f"train.parallel={spec['parallel']}",
             f"train.activation_checkpointing={spec['ac']}"] + [f"model.{k}={v}" for k, v in spec["model"].items()]
    items += ["train.device=cpu"] if spec["cpu"] else []
    cfg = build_run("lm", spec["preset"], attention=spec["kind"], data=spec["data"], data_dir=spec["data_dir"],
                    overrides=items)
    task = build_task("lm") if spec["data"] else RandomLM()
    if spec["data"]:  # the timing needs no evaluation
        task.evaluate, task.final = (lambda model: {task.metric: 0.0}), (lambda model: {"score": 0.0})
    rank = int(os.environ.get("RANK", "0"))
    trainer = Trainer(cfg, task, spec["out"], log=print if rank == 0 else (lambda *_: None))
    if not spec.get("profile"):
        trainer.fit()
        return
    activity = torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        trainer.fit()
    if rank == 0:
        write_profile(prof, spec)


def write_profile(prof, spec: dict) -> None:
    """GPU time per step by kernel category, the SDPA backend and the top kernels of a profiled
    run (every step, the first's compilation included), next to the run's log."""
    from mhe.bench.profiling import by_category, kernel_times, sdpa_calls

    steps = spec["steps"]
    times = kernel_times(prof, steps)
    lines = [f"# {spec['name']}: GPU ms per step over all {steps} steps (rank 0)", "",
             f"SDPA: {sdpa_calls(prof, steps)}; GPU busy {sum(ms for ms, _ in times.values()):.1f} ms per step", "",
             "| category | ms per step |", "|---|---:|"]
    lines += [f"| {c} | {ms:.2f} |" for c, ms in by_category(times).items() if ms > 0]
    lines += ["", "| kernel | ms per step | launches per step |", "|---|---:|---:|"]
    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:25]
    lines += [f"| {name[:110]} | {ms:.2f} | {n:g} |" for name, (ms, n) in top]
    (Path(spec["out"]).parent.parent / "logs" / f"profile-{spec['name']}.md").write_text("\n".join(lines) + "\n")


class Runner:
    """Runs each stage under torchrun, logged, none past the deadline."""

    def __init__(self, out: Path, gpus: int, deadline: float) -> None:
        self.out, self.gpus, self.deadline, self.t0 = out, gpus, deadline, time.monotonic()
        self.commands: list[str] = []

    def run(self, stage: dict, spec: dict) -> str:
        left = self.deadline - (time.monotonic() - self.t0)
        if left < 30:
            return "skipped: the deadline had passed"
        path = self.out / "runs" / f"{stage['name']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.gpus}",
               str(BENCHMARKS / "train_bench.py"), "fsdp", "--worker", str(path)]
        self.commands.append(f"{stage['name']}: `torchrun --standalone --nproc_per_node {self.gpus} "
                             f"benchmarks/train_bench.py fsdp --worker {path.name}` ({describe(stage)})")
        print(f"[{stage['name']}] {describe(stage)} ({left:.0f} s left)", flush=True)
        env = child_env(PYTHONUNBUFFERED="1")
        log, start = self.out / "logs" / f"{stage['name']}.log", time.monotonic()
        with log.open("w") as f:
            proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:  # killed: a signal would make it save a checkpoint
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = "stopped at the deadline"
        print(f"[{stage['name']}] rc={rc} in {time.monotonic() - start:.0f} s", flush=True)
        if rc == 0:
            return "ok"
        text = log.read_text(errors="replace")
        return "out of memory (measured)" if "OutOfMemoryError" in text or "out of memory" in text else f"failed ({rc})"


def describe(stage: dict) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in stage["model"].items() if k != "max_len")
    return (f"{stage['preset']}{' (' + shape + ')' if shape else ''}, {stage['kind']}, {stage['parallel']}, "
            f"activation checkpointing {stage['ac']}, {stage['per_gpu']} x {stage['seq']} tokens per GPU")


def figures(run: Path, stage: dict, gpus: int) -> dict | None:
    """Median input tokens/s after the first third of the steps (all GPUs, per GPU) and rank 0's peak GiB."""
    metrics = run / "metrics.jsonl"
    if not metrics.exists():
        return None
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    records = [r for r in records if "step_s" in r]
    if not records:
        return None
    late = [r for r in records if r["step"] > stage["steps"] // 3] or records[-1:]
    tok_s = stage["per_gpu"] * gpus * stage["seq"] / statistics.median(r["step_s"] for r in late)
    memory = [r["max_mem_gib"] for r in records if "max_mem_gib" in r]
    results = run / "results.json"  # the built model's count (a corpus's tokenizer sets the vocabulary)
    params = json.loads(results.read_text()).get("total_params") if results.exists() else None
    return {"tokens_per_s": tok_s, "per_gpu": tok_s / gpus, "peak_gib": max(memory) if memory else None,
            "params": params}


def mfu(stage: dict, f: dict | None, peak: float | None) -> str:
    """Model FLOPs utilisation per GPU: (6N + 12 L T n d) x tokens/s per GPU over the card's dense
    bf16 peak (:func:`mhe.bench.common.flops_per_token`, N every real parameter)."""
    if not f or not peak or not f.get("params"):
        return "-"
    cfg = model_preset(stage["preset"]).replace(attention=stage["kind"], **stage["model"])
    return f"{100 * flops_per_token(f['params'], cfg, stage['seq']) * f['per_gpu'] / peak:.1f}%"


def vs_ddp(stage: dict, f: dict | None, results) -> str:
    """FSDP's rate over the same kind's DDP rate in this run."""
    twin = next((g for s, st, g in results if s["kind"] == stage["kind"] and s["parallel"] == "ddp"
                 and s["preset"] == stage["preset"] and s["model"] == stage["model"] and st == "ok" and g), None)
    return f"{f['tokens_per_s'] / twin['tokens_per_s']:.2f}x" if f and twin and stage["parallel"] == "fsdp" else "-"


def table(results: list[tuple[dict, str, dict | None]], gpus: int, card_gib: float | None,
          peak: float | None = None) -> list[str]:
    lines = ["| run | parameters | parallel | act. ckpt | tokens/s (all GPUs) | tokens/s per GPU | MFU | FSDP/DDP "
             "| peak GiB (rank 0) | 16 B/param (DDP's state) |", "|---|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for stage, status, f in results:
        params = (f or {}).get("params") or n_params(stage["preset"], stage["kind"], stage["model"])
        bound = 16 * params / GIB
        over = f" > {card_gib:.0f} GiB card" if card_gib and bound > card_gib else ""
        label = f"{stage['name']}: {stage['kind']}, {stage['per_gpu']} x {stage['seq']} per GPU"
        cells = (f"{f['tokens_per_s']:,.0f} | {f['per_gpu']:,.0f} | {mfu(stage, f, peak)} | "
                 f"{vs_ddp(stage, f, results)} | "
                 f"{'-' if f['peak_gib'] is None else format(f['peak_gib'], '.1f')}") if f and status == "ok" \
            else f"{status} | | | | "
        size = f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M"
        lines.append(f"| {label} | {size} | {stage['parallel']} | {stage['ac']} | {cells} | {bound:.3g} GiB{over} |")
    big = next((s for s, _, _ in results if s["name"] == "big-mha-fsdp"), None)
    if big and card_gib and not any(s["name"] == "big-mha-ddp" for s, _, _ in results):
        bound = 16 * n_params(big["preset"], "mha", big["model"]) / GIB
        lines += ["", f"big-mha under DDP was not run: its weights, gradients and AdamW moments alone take "
                      f"{bound:.1f} GiB per GPU (16 bytes x parameters, a computed bound before activations), "
                      f"more than the card's {card_gib:.1f} GiB; under FSDP each of the {gpus} GPUs holds "
                      f"{bound / gpus:.1f} GiB of it."]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train_bench.py fsdp", description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--gpus", type=int, choices=(2, 4), default=2)
    ap.add_argument("--gpt2", action="store_true", help="GPT-2-shaped models instead of the Llama-style family")
    ap.add_argument("--data", default="", help="a corpus mhe pretrain reads (default: random tokens)")
    ap.add_argument("--data-dir", default=os.environ.get("MHE_DATA", ""))
    ap.add_argument("--deadline", type=float, default=400.0)
    ap.add_argument("--steps", type=int, default=30, help="steps of each llama-1.1b run (the first third is warm-up)")
    ap.add_argument("--ddp-oom", action="store_true", help="also try the big model under DDP")
    ap.add_argument("--only", default="", help="comma-separated stage names to run (default: all)")
    ap.add_argument("--cpu-smoke", action="store_true", help="two gloo processes, tiny presets, a few steps")
    ap.add_argument("--profile", action="store_true",
                    help="profile every run's GPU kernels (OUT/logs/profile-STAGE.md); slows the runs")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(Path(a.worker).read_text()))
        return 0
    if not a.out:
        ap.error("OUT is required")
    out = Path(a.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available() and not a.cpu_smoke
    if not cuda and not a.cpu_smoke:
        ap.error("no CUDA device: run on a GPU host, or pass --cpu-smoke")
    card = torch.cuda.get_device_name(0) if cuda else "CPU (gloo)"
    card_gib = torch.cuda.get_device_properties(0).total_memory / GIB if cuda else None
    gpus = a.gpus if cuda else 2
    print(f"cards: {gpus} x {card}; torch {torch.__version__}", flush=True)
    runner = Runner(out, gpus, a.deadline)
    results = []
    chosen = [s for s in stages(a, card_gib) if not a.only or s["name"] in a.only.split(",")]
    for stage in chosen:
        first = out / "runs" / "base-mha-ddp" / "tokenizer.json"  # a corpus: every run reuses the first's tokenizer
        if a.data and first.is_file() and not (out / "runs" / stage["name"]).exists():
            (out / "runs" / stage["name"]).mkdir(parents=True)
            shutil.copy(first, out / "runs" / stage["name"] / "tokenizer.json")
        spec = dict(stage, out=str(out / "runs" / stage["name"]), data=a.data, profile=a.profile,
                    data_dir=str(Path(a.data_dir).resolve()) if a.data_dir else "", cpu=not cuda)
        status = runner.run(stage, spec)
        results.append((stage, status, figures(out / "runs" / stage["name"], stage, gpus)))
    memory = f" ({card_gib:.1f} GiB each)" if card_gib else ""
    head = [f"# DDP and FSDP on {gpus} GPUs of one host", "",
            f"Cards: {gpus} x {card}{memory}; torch {torch.__version__}; `python benchmarks/train_bench.py fsdp OUT "
            f"--gpus {gpus}{' --gpt2' if a.gpt2 else ''}{' --cpu-smoke' if a.cpu_smoke else ''}`; data: "
            f"{a.data or 'random tokens'}; tokens/s: median logged step time after the first third of the steps; "
            f"MFU: (6N + 12 L T n d) FLOPs per token x tokens/s per GPU over the card's dense bf16 peak.",
            "", "Commands:", ""] + [f"* {c}" for c in runner.commands] + [""]
    text = "\n".join(head + table(results, gpus, card_gib, device_peak(card) if cuda else None)) + "\n"
    (out / "fsdp-speed.md").write_text(text)
    print("\n" + text)
    return 0

