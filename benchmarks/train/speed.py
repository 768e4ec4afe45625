"""Training speed where users train: `mhe pretrain` beside `mhe bench`'s step, one card, one run.

    python benchmarks/train_bench.py speed OUT [--gpus 1|2|4] [--grad-reduce-bf16] [--stages A,B,...]
        [--data-dir DIR] [--deadline SECONDS] [--cpu-smoke]

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
one GPU and on four at global batch 32. The stages are named ``KIND-Ngpu-bB`` (``mha-2gpu-b64``:
MHA on two GPUs at global batch 64).

``--grad-reduce-bf16`` (``--gpus 2|4``) adds, right after the two MHA rows of each GPU count, the
same two runs with ``--set train.grad_reduce=bf16`` (DDP all-reduces the gradients in bf16, half
the bytes; stages ``...-bf16reduce``, rows "bf16 all-reduce"; a run whose torch refused the hook,
as on a CPU, reduced in float32 and its row says so). ``--stages A,B`` (``--gpus 2|4``) runs only
the named stages, in the order above, and the table lists only those; "vs one GPU" needs the
one-GPU stage of the same kind among them. An unknown name is refused, listing the valid ones.

Each pre-training run adds ``train.keep_checkpoints=false`` (no 1.5 GB checkpoint written at the
end; the steps are untouched), and the later runs of a preset start from the first run's
``tokenizer.json`` (the one they would train: same corpus and settings), as a resumed run does,
which saves its training time. Rates are the medians of the logged step times after step 40
(the first intervals hold the compilation), as input tokens per second over all GPUs (``batch x
512`` a step; for masked LM as well, whose own log counts the masked tokens); MFU is the formula
of ``mhe bench`` (6N + 12 L T n d FLOPs per token over the card's dense bf16 peak, per GPU).
Stages run in the order above; once ``--deadline`` seconds have passed (default 450 for one GPU,
270 for two, 560 for four or with ``--grad-reduce-bf16``: on four GPUs its eleven stages need
more, so choose with ``--stages``) the rest are skipped and a running one is stopped, and the
tables say so.

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
from pathlib import Path
from typing import NamedTuple

import torch

from train.runs import Runner, fmt, log_says, pct, ratio, run_figures, seed_tokenizer

BF16_REDUCE = "train.grad_reduce=bf16"
REFUSED = "train.grad_reduce=bf16 has no effect here"  # the trainer's note where torch refuses the hook


class Plan:
    """Sizes of the real measurement and of the CPU smoke check."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.decoder, self.encoder = ("tiny-decoder", "tiny-encoder") if smoke else ("gpt2-base", "bert-base")
        self.data = "ptb" if smoke else "wikitext-2"
        self.steps, self.after, self.batch, self.seq = (8, 4, 8, 64) if smoke else (120, 40, 32, 512)
        self.extra = (["--set", "train.device=cpu", "--set", "train.log_every=2", "--set", "data.limit_lines=300",
                       "--set", "data.vocab_size=400"] if smoke else [])

    def pretrain(self, preset: str, kind: str, out: Path, batch: int | None = None,
                 sets: tuple[str, ...] = ()) -> list[str]:
        return ["pretrain", "--preset", preset, "--data", self.data, "--attention", kind, "--out", str(out),
                "--set", f"train.steps={self.steps}", "--set", "train.keep_checkpoints=false",
                "--set", "train.progress=false"] + self.extra + \
               (["--set", f"train.batch_size={batch}"] if batch else []) + [a for v in sets for a in ("--set", v)]

    def bench(self, out: Path) -> list[str]:
        size = ["--smoke", "--reps", "2", "--trainer-steps", "6"] if self.smoke else ["--compile", "--train-batch",
                                                                                      "32", "--trainer-steps", "60"]
        return ["bench", "--sections", "train", "--presets", self.decoder, "--kinds", "mha,mhe-mul",
                "--json", str(out / "bench-train.json"), *size]  # smoke: eager (inductor on a CPU takes minutes)


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


class Stage(NamedTuple):
    """One run of the several-GPU mode: its name (the run folder and log), attention kind, GPU
    count, global batch and whether its gradients are all-reduced in bf16."""

    name: str
    kind: str
    gpus: int
    batch: int
    bf16_reduce: bool = False


def gpu_stages(gpus: int, batch: int, bf16_reduce: bool = False) -> list[Stage]:
    """The stages of the several-GPU mode, in the order they run: MHA on one GPU, then on 2 (and 4)
    at the same per-GPU batch and at the same global batch (with ``bf16_reduce``, each of the two
    again with its gradients all-reduced in bf16), then MHE-Mul on one GPU and on all of them at
    the same global batch."""
    stages = [Stage(f"mha-1gpu-b{batch}", "mha", 1, batch)]
    for n in (n for n in (2, 4) if n <= gpus):
        pair = [Stage(f"mha-{n}gpu-b{n * batch}", "mha", n, n * batch), Stage(f"mha-{n}gpu-b{batch}", "mha", n, batch)]
        stages += pair + ([s._replace(name=f"{s.name}-bf16reduce", bf16_reduce=True) for s in pair] if bf16_reduce else [])
    return stages + [Stage(f"mhe-mul-1gpu-b{batch}", "mhe-mul", 1, batch),
                     Stage(f"mhe-mul-{gpus}gpu-b{batch}", "mhe-mul", gpus, batch)]


def several_gpus(plan: Plan, runner: Runner, out: Path, gpus: int, stages: list[Stage]) -> list[str]:
    """Run ``stages`` in order (the tokenizer of the first one seeds the others) and tabulate
    them; "vs one GPU" needs the one-GPU stage of the same kind among them."""
    lines = [f"### {plan.decoder}, compiled (the default), {gpus} GPUs of one host", "",
             "| run | tokens/s (all GPUs) | per GPU | vs one GPU | MFU per GPU | peak GiB (rank 0) |",
             "|---|---:|---:|---:|---:|---:|"]
    base = {}
    for s in stages:
        seed_tokenizer(out / "runs" / stages[0].name, out / "runs" / s.name)
        runner.run(s.name, plan.pretrain(plan.decoder, s.kind, out / "runs" / s.name, s.batch,
                                         (BF16_REDUCE,) if s.bf16_reduce else ()), gpus=s.gpus)
        f = run_figures(out / "runs" / s.name, plan.after, s.gpus)
        if s.gpus == 1 and f:
            base[s.kind] = f["tokens_per_s"]
        lines.append(_gpu_row(s, f, base.get(s.kind), log_says(out, s.name, REFUSED)))
    if any(s.bf16_reduce for s in stages):
        lines += ["", f"bf16 all-reduce: `--set {BF16_REDUCE}` (DDP's bf16_compress_hook: each gradient bucket "
                  "cast to bf16 for the all-reduce and back; \"refused\": torch lacked the hook's CUDA and NCCL "
                  "and the run reduced in float32)."]
    return lines


def _gpu_row(s: Stage, f: dict | None, base: float | None, refused: bool) -> str:
    """The table row of stage ``s`` (its figures ``f``; None: not measured)."""
    label = f"{s.kind}, {s.gpus} GPU{'s' if s.gpus > 1 else ''}, global batch {s.batch} ({s.batch // s.gpus} per GPU)"
    if s.bf16_reduce:
        label += ", bf16 all-reduce" + (" (refused: float32)" if refused else "")
    if f is None:
        return f"| {label} | not measured | | | | |"
    return (f"| {label} | {fmt(f['tokens_per_s'])} | {fmt(f['per_gpu'])} | {ratio(f['tokens_per_s'], base)} | "
            f"{pct(f['mfu'])} | {fmt(f['peak_gib'], '.2f')} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train_bench.py speed", description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--gpus", type=int, choices=(1, 2, 4), default=1)
    ap.add_argument("--data-dir", default=os.environ.get("MHE_DATA", "data-cache"))
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds (default 450 for one GPU, 270 for two, 560 for four or with --grad-reduce-bf16)")
    ap.add_argument("--grad-reduce-bf16", action="store_true",
                    help="--gpus 2|4: also run MHA's several-GPU stages with train.grad_reduce=bf16")
    ap.add_argument("--stages", default="", help="--gpus 2|4: run only these stages (comma-separated names)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny presets, PTB, a few steps, on the CPU")
    a = ap.parse_args(argv)
    if a.gpus == 1 and (a.grad_reduce_bf16 or a.stages):
        ap.error("--grad-reduce-bf16 and --stages apply to --gpus 2 or 4")
    a.plan = Plan(a.cpu_smoke)
    every = gpu_stages(a.gpus, a.plan.batch, a.grad_reduce_bf16) if a.gpus > 1 else []
    names = [n.strip() for n in a.stages.split(",") if n.strip()]
    unknown = [n for n in names if n not in {s.name for s in every}]
    if unknown or (a.stages and not names):
        ap.error(f"unknown stage(s) {', '.join(unknown) or repr(a.stages)}; valid here: {', '.join(s.name for s in every)}")
    a.selected = [s for s in every if not names or s.name in names]
    return a


def command(a: argparse.Namespace) -> str:
    """The command line of this run, for the report's header."""
    flags = [f"--gpus {a.gpus}"] + (["--grad-reduce-bf16"] if a.grad_reduce_bf16 else []) + \
        ([f"--stages {a.stages}"] if a.stages else []) + (["--cpu-smoke"] if a.cpu_smoke else [])
    return f"python benchmarks/train_bench.py speed OUT {' '.join(flags)}"


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out, plan = Path(a.out).resolve(), a.plan
    (out / "logs").mkdir(parents=True, exist_ok=True)
    deadline = a.deadline or (560 if a.grad_reduce_bf16 else {1: 450, 2: 270, 4: 560}[a.gpus])
    runner = Runner(out, str(Path(a.data_dir).resolve()), deadline)
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"card: {card}; {torch.cuda.device_count()} visible; torch {torch.__version__}", flush=True)
    lines = one_gpu(plan, runner, out) if a.gpus == 1 else several_gpus(plan, runner, out, a.gpus, a.selected)
    head = [f"# Training speed ({'one GPU' if a.gpus == 1 else f'{a.gpus} GPUs'})", "",
            f"Card: {card}; torch {torch.__version__}; `{command(a)}`; rates: median logged step time after step "
            f"{plan.after}, as input tokens/s; MFU: (6N + 12 L T n d) x tokens/s / dense bf16 peak, per GPU.", "",
            "Commands:", ""] + [f"* {c}" for c in runner.commands] + [""]
    if runner.skipped:
        head += [f"Not measured: {', '.join(runner.skipped)}.", ""]
    text = "\n".join(head + lines) + "\n"
    (out / "train-speed.md").write_text(text)
    print("\n" + text)
    return 0

