"""Training speed where users train: `mhe pretrain` beside `mhe bench`'s step, one card, one run.

    python benchmarks/train_speed.py OUT [--gpus 1|2] [--data-dir DIR] [--deadline SECONDS] [--cpu-smoke]

``--gpus 1`` (default; about 8 minutes on one H100) measures, in this order:

* ``bench``: ``mhe bench --sections train --compile --presets gpt2-base --kinds mha,mhe-mul
  --train-batch 32`` (the step alone, and the trainer on random tokens, side by side);
* ``gpt2-K``: ``mhe pretrain --preset gpt2-base --data wikitext-2 --attention K --set
  train.steps=120`` with every other setting at its default, for K = mha, mhe-mul;
* ``bert-K``: the same for ``bert-base`` (masked LM), K = mha, mhe-mul.

``--gpus 2`` (about 5 minutes on two GPUs of one host) measures gpt2-base MHA on one GPU at batch
32, then under ``torchrun --nproc_per_node 2`` at the same per-GPU batch (global batch 64) and at
the same global batch 32, then MHE-Mul on one GPU and on two at global batch 32. ``--gpus 4``
(about 9.5 minutes on four GPUs of one host) measures MHA on one GPU, then on two and on four GPUs
at the same per-GPU batch 32 (global 64 and 128) and at the same global batch 32, then MHE-Mul on
one GPU and on four at global batch 32.

Each pre-training run adds ``train.keep_checkpoints=false`` (no 1.5 GB checkpoint written at the
end; the steps are untouched), and the later runs of a preset start from the first run's
``tokenizer.json`` (the one they would train: same corpus and settings), as a resumed run does,
which saves its training time. Rates are the medians of the logged step times after step 40
(the first intervals hold the compilation), as input tokens per second over all GPUs (``batch x
512`` a step; for masked LM as well, whose own log counts the masked tokens); MFU is the formula
of ``mhe bench`` (6N + 12 L T n d FLOPs per token over the card's dense bf16 peak, per GPU).
Stages run in the order above; once ``--deadline`` seconds have passed (default 450 for one GPU,
270 for two, 560 for four) the rest are skipped and a running one is stopped, and the tables say so.

Out: ``OUT/train-speed.md`` (card, torch, commands, tables), ``OUT/logs/STAGE.log`` (each
command's output), ``OUT/runs/STAGE/`` (config, metrics and results of each run) and
``OUT/bench-train.json``. Data: ``--data-dir`` (default ``$MHE_DATA``, else ``data-cache``) must
hold ``wikitext-2/wiki.{train,valid,test}.tokens[.gz|.xz]``. ``--cpu-smoke`` runs the same
logic on a CPU with tiny presets on PTB and a few steps (the 2-GPU mode as two gloo processes),
to check the script end to end.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from mhe.bench.common import device_peak, flops_per_token  # noqa: E402
from mhe.models.config import ModelConfig  # noqa: E402


class Plan:
    """Sizes of the real measurement and of the CPU smoke check."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.decoder, self.encoder = ("tiny-decoder", "tiny-encoder") if smoke else ("gpt2-base", "bert-base")
        self.data = "ptb" if smoke else "wikitext-2"
        self.steps, self.after, self.batch, self.seq = (8, 4, 8, 64) if smoke else (120, 40, 32, 512)
        self.extra = (["--set", "train.device=cpu", "--set", "train.log_every=2", "--set", "data.limit_lines=300",
                       "--set", "data.vocab_size=400"] if smoke else [])

    def pretrain(self, preset: str, kind: str, out: Path, batch: int | None = None) -> list[str]:
        return ["pretrain", "--preset", preset, "--data", self.data, "--attention", kind, "--out", str(out),
                "--set", f"train.steps={self.steps}", "--set", "train.keep_checkpoints=false",
                "--set", "train.progress=false"] + self.extra + \
               (["--set", f"train.batch_size={batch}"] if batch else [])

    def bench(self, out: Path) -> list[str]:
        size = ["--smoke", "--reps", "2", "--trainer-steps", "6"] if self.smoke else ["--compile", "--train-batch",
                                                                                      "32", "--trainer-steps", "60"]
        return ["bench", "--sections", "train", "--presets", self.decoder, "--kinds", "mha,mhe-mul",
                "--json", str(out / "bench-train.json"), *size]  # smoke: eager (inductor on a CPU takes minutes)


class Runner:
    """Runs the stages as subprocesses, each logged, none past the deadline."""

    def __init__(self, out: Path, data_dir: str, deadline: float) -> None:
        self.out, self.deadline, self.t0 = out, deadline, time.monotonic()
        self.env = dict(os.environ, MHE_DATA=data_dir, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        self.commands: list[str] = []
        self.skipped: list[str] = []

    def run(self, stage: str, args: list[str], *, gpus: int = 1) -> bool:
        left = self.deadline - (time.monotonic() - self.t0)
        if left < 20:
            self.skipped.append(stage)
            print(f"[{stage}] skipped: the deadline has passed", flush=True)
            return False
        launch = [sys.executable, "-m", "mhe"] if gpus == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", "-m", "mhe"]
        env = dict(self.env, **({"CUDA_VISIBLE_DEVICES": "0"} if gpus == 1 and torch.cuda.is_available() else {}))
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


def one_gpu(plan: Plan, runner: Runner, out: Path) -> list[str]:
    runner.run("bench", plan.bench(out))
    runs = {}
    for arch, preset in (("gpt2", plan.decoder), ("bert", plan.encoder)):
        for kind in ("mha", "mhe-mul"):
            stage = f"{arch}-{kind}"
            seed_tokenizer(out / "runs" / f"{arch}-mha", out / "runs" / stage)
            runner.run(stage, plan.pretrain(preset, kind, out / "runs" / stage))
            runs[stage] = run_figures(out / "runs" / stage, plan.after, 1)
    bench = json.loads((out / "bench-train.json").read_text())["training"] if (out / "bench-train.json").exists() else []
    cell = {(r["kind"], r["path"]): r for r in bench}
    lines = [f"### {plan.decoder}, batch {plan.batch} x {plan.seq}, bf16 (one GPU)", "",
             "| path | MHA tokens/s | MHA MFU | MHE-Mul tokens/s | MHE-Mul / MHA | MHA peak GiB | MHE-Mul peak GiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    paths = [("`mhe bench --sections train --compile` (the step alone)", "step"),
             ("`mhe bench` trainer row (random tokens, defaults)", "mhe pretrain")]
    for label, path in paths:
        a, b = cell.get(("mha", path)), cell.get(("mhe-mul", path))
        get = lambda r, k: None if r is None else r.get(k)  # noqa: E731
        lines.append(f"| {label} | {fmt(get(a, 'tokens_per_s'))} | {pct(get(a, 'mfu'))} | {fmt(get(b, 'tokens_per_s'))} | "
                     f"{ratio(get(b, 'tokens_per_s'), get(a, 'tokens_per_s'))} | {fmt(get(a, 'peak_mem_gib'), '.2f')} | "
                     f"{fmt(get(b, 'peak_mem_gib'), '.2f')} |")
    a, b = runs.get("gpt2-mha"), runs.get("gpt2-mhe-mul")
    lines.append(_pretrain_row(f"`mhe pretrain --data {plan.data}`, defaults", a, b))
    step = cell.get(("mha", "step"))
    lines += ["", f"`mhe pretrain` / the bench's step (MHA): {ratio(a and a['tokens_per_s'], step and step['tokens_per_s'])}; "
              f"(MHE-Mul): {ratio(b and b['tokens_per_s'], cell.get(('mhe-mul', 'step'), {}).get('tokens_per_s'))}", "",
              f"### {plan.encoder}, masked LM, batch {plan.batch} x {plan.seq} (one GPU)", "",
              "| path | MHA tokens/s | MHA MFU | MHE-Mul tokens/s | MHE-Mul / MHA | MHA peak GiB | MHE-Mul peak GiB |",
              "|---|---:|---:|---:|---:|---:|---:|",
              _pretrain_row(f"`mhe pretrain --data {plan.data}`, defaults", runs.get("bert-mha"), runs.get("bert-mhe-mul"))]
    return lines


def _pretrain_row(label: str, a: dict | None, b: dict | None) -> str:
    g = lambda r, k: None if r is None else r[k]  # noqa: E731
    return (f"| {label} | {fmt(g(a, 'tokens_per_s'))} | {pct(g(a, 'mfu'))} | {fmt(g(b, 'tokens_per_s'))} | "
            f"{ratio(g(b, 'tokens_per_s'), g(a, 'tokens_per_s'))} | {fmt(g(a, 'peak_gib'), '.2f')} | "
            f"{fmt(g(b, 'peak_gib'), '.2f')} |")


def gpu_stages(gpus: int, batch: int) -> list[tuple[str, str, int, int]]:
    """(stage, kind, GPUs, global batch) of the several-GPU mode, in the order they run: MHA on one
    GPU, then on 2 (and 4) at the same per-GPU batch and at the same global batch, then MHE-Mul on
    one GPU and on all of them at the same global batch."""
    counts = [n for n in (2, 4) if n <= gpus]
    stages = [(f"mha-1gpu-b{batch}", "mha", 1, batch)]
    for n in counts:
        stages += [(f"mha-{n}gpu-b{n * batch}", "mha", n, n * batch), (f"mha-{n}gpu-b{batch}", "mha", n, batch)]
    return stages + [(f"mhe-mul-1gpu-b{batch}", "mhe-mul", 1, batch), (f"mhe-mul-{gpus}gpu-b{batch}", "mhe-mul", gpus, batch)]


def several_gpus(plan: Plan, runner: Runner, out: Path, gpus: int) -> list[str]:
    stages = gpu_stages(gpus, plan.batch)
    lines = [f"### {plan.decoder}, compiled (the default), {gpus} GPUs of one host", "",
             "| run | tokens/s (all GPUs) | per GPU | vs one GPU | MFU per GPU | peak GiB (rank 0) |",
             "|---|---:|---:|---:|---:|---:|"]
    base = {}
    for stage, kind, gpus, batch in stages:
        seed_tokenizer(out / "runs" / stages[0][0], out / "runs" / stage)
        runner.run(stage, plan.pretrain(plan.decoder, kind, out / "runs" / stage, batch), gpus=gpus)
        f = run_figures(out / "runs" / stage, plan.after, gpus)
        if gpus == 1 and f:
            base[kind] = f["tokens_per_s"]
        label = f"{kind}, {gpus} GPU{'s' if gpus > 1 else ''}, global batch {batch} ({batch // gpus} per GPU)"
        if f is None:
            lines.append(f"| {label} | not measured | | | | |")
            continue
        lines.append(f"| {label} | {fmt(f['tokens_per_s'])} | {fmt(f['per_gpu'])} | "
                     f"{ratio(f['tokens_per_s'], base.get(kind))} | {pct(f['mfu'])} | {fmt(f['peak_gib'], '.2f')} |")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gpus", type=int, choices=(1, 2, 4), default=1)
    ap.add_argument("--data-dir", default=os.environ.get("MHE_DATA", "data-cache"))
    ap.add_argument("--deadline", type=float, default=None, help="seconds (default 450 for one GPU, 270 for two, 560 for four)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny presets, PTB, a few steps, on the CPU")
    a = ap.parse_args()
    out = Path(a.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    plan = Plan(a.cpu_smoke)
    data_dir = str(Path(a.data_dir).resolve())
    runner = Runner(out, data_dir, a.deadline or {1: 450, 2: 270, 4: 560}[a.gpus])
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"card: {card}; {torch.cuda.device_count()} visible; torch {torch.__version__}", flush=True)
    lines = one_gpu(plan, runner, out) if a.gpus == 1 else several_gpus(plan, runner, out, a.gpus)
    head = [f"# Training speed ({'one GPU' if a.gpus == 1 else f'{a.gpus} GPUs'})", "",
            f"Card: {card}; torch {torch.__version__}; `python benchmarks/train_speed.py OUT --gpus {a.gpus}"
            f"{' --cpu-smoke' if a.cpu_smoke else ''}`; rates: median logged step time after step {plan.after}, "
            "as input tokens/s; MFU: (6N + 12 L T n d) x tokens/s / dense bf16 peak, per GPU.", "",
            "Commands:", ""] + [f"* {c}" for c in runner.commands] + [""]
    if runner.skipped:
        head += [f"Not measured: {', '.join(runner.skipped)}.", ""]
    text = "\n".join(head + lines) + "\n"
    (out / "train-speed.md").write_text(text)
    print("\n" + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
