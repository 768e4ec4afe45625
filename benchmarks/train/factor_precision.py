"""MHE-Mul's per-head factors under bf16 autocast: float32 values (two bf16 terms) against one bf16 term.

    python benchmarks/train_bench.py factor-precision              # llama-135m, WikiText-2, 300 steps, cuda:0
    python benchmarks/train_bench.py factor-precision --cpu-smoke  # tiny-decoder, a few steps on a CPU

Under autograd MHE-Mul multiplies the shared query by its per-head factors as one matrix product
(``mhe.attention.mhe._scaled_heads``). Under bf16 autocast that product would round the float32
factors ``1 + e`` to bf16 (8 mantissa bits: a head embedding's update below 1/256 of the factor
vanishes); the library feeds them as two bf16 terms (``f_hi + f_lo``) so the product sees float32
values. This script trains the same run twice from one seed, once as the library does
(``two-term``) and once with the second term zeroed (``one-term``: the factors rounded to bf16),
each form in a process of its own, both at once on the same card, and prints both loss curves, the
largest gap between them and each run's validation and test perplexity. The runs land in ``--out``
(default ``runs/factor-precision``); the table goes to standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from toolbox import BENCHMARKS

FORMS = ("two-term", "one-term")


def one_term_scaled_heads():
    """``_scaled_heads`` with its second term zeroed: the factors rounded once to the product's dtype."""
    import torch

    from mhe.attention import mhe

    exact = mhe._scaled_heads

    def rounded(a, f):
        dtype = torch.get_autocast_dtype(a.device.type) if torch.is_autocast_enabled(a.device.type) else a.dtype
        return exact(a, f.to(dtype).to(f.dtype))  # f_lo = f - round(f) = 0
    return rounded


def child(form: str, out: Path, args: list[str]) -> int:
    """One run of ``mhe pretrain`` with the factors in ``form``."""
    from mhe.attention import mhe
    from mhe.cli import main

    if form == "one-term":
        mhe._scaled_heads = one_term_scaled_heads()
    return main(["pretrain", *args, "--out", str(out / form)])


def pretrain_args(a) -> list[str]:
    if a.cpu_smoke:
        return ["--preset", "tiny-decoder", "--attention", "mhe-mul", "--data", "offline-english", "--set",
                "train.steps=6", "--set", "train.eval_every=3", "--set", "train.log_every=2", "--set",
                "data.limit_lines=200", "--set", "train.precision=bf16", "--set", "train.compile=false",
                "--set", "train.progress=false", "--set", "train.device=cpu", "--set", "model.n_layers=1"]
    return ["--preset", a.preset, "--attention", "mhe-mul", "--data", a.data, "--set", f"train.steps={a.steps}",
            "--set", f"train.warmup_steps={max(1, a.steps // 10)}", "--set", f"train.lr={a.lr}",
            "--set", f"train.eval_every={max(1, a.steps // 3)}", "--set", "train.log_every=10", "--set",
            "train.precision=bf16", "--set", "train.progress=false", "--set", f"train.device={a.device}"]


def curves(out: Path) -> dict[str, dict]:
    """Each form's logged training losses by step and its results."""
    from mhe.training.run_files import read_metrics

    found = {}
    for form in FORMS:
        run = out / form
        losses = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
        results = json.loads((run / "results.json").read_text()) if (run / "results.json").is_file() else {}
        found[form] = {"losses": losses, "results": results}
    return found


def table(found: dict[str, dict]) -> str:
    steps = sorted(set(found[FORMS[0]]["losses"]) & set(found[FORMS[1]]["losses"]))
    lines = ["| step | two-term loss | one-term loss | one - two |", "|---:|---:|---:|---:|"]
    for s in steps:
        a, b = found["two-term"]["losses"][s], found["one-term"]["losses"][s]
        lines.append(f"| {s} | {a:.4f} | {b:.4f} | {b - a:+.4f} |")
    gaps = [abs(found["one-term"]["losses"][s] - found["two-term"]["losses"][s]) for s in steps]
    lines.append("")
    lines.append(f"largest |gap| over {len(steps)} logged steps: {max(gaps, default=float('nan')):.4f}")
    for form in FORMS:
        r = found[form]["results"]
        keys = [k for k in sorted(r) if "perplexity" in k or k in ("status", "device")]
        lines.append(f"{form}: " + ", ".join(f"{k} {r[k]}" for k in keys))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="train_bench.py factor-precision", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama-135m")
    ap.add_argument("--data", default="wikitext-2")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="peak learning rate, reached after a tenth of the steps (the preset's schedule is a "
                         "pre-training's: 10,000 warm-up steps would leave a short run at a vanishing rate)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("runs/factor-precision"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny-decoder, a few steps on a CPU")
    ap.add_argument("--child", choices=FORMS, help=argparse.SUPPRESS)
    a, extra = ap.parse_known_args(argv)
    if a.steps < 1:
        ap.error(f"--steps must be at least 1, got {a.steps}")
    args = pretrain_args(a) + extra
    if a.child:
        return child(a.child, a.out, args)
    tool = [sys.executable, str(BENCHMARKS / "train_bench.py"), "factor-precision"]
    procs = [subprocess.Popen([*tool, "--child", form, "--out", str(a.out), *argv],
                              env={**os.environ, "PYTHONUNBUFFERED": "1"}) for form in FORMS]
    codes = [p.wait() for p in procs]
    if any(codes):
        print(f"train_bench.py factor-precision: a run failed (exit codes {dict(zip(FORMS, codes))})", file=sys.stderr)
        return 1
    print(table(curves(a.out)))
    return 0

