"""DDP check: the same run on one GPU and on N GPUs (torchrun) at the same global batch.

    python benchmarks/ddp_check.py --gpus 2 --out DIR [--data-dir DIR]

Runs ``mhe train`` twice with dropout off (so the only differences are
floating-point ones: bf16 autocast and the order of the gradient reduction),
then prints the per-step losses side by side and the largest relative gap.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

COMMON = ["train", "--task", "lm", "--preset", "tiny-decoder", "--data", "ptb", "--attention", "mhe-mul",
          "--set", "train.steps=200", "--set", "train.batch_size=32", "--set", "train.log_every=1",
          "--set", "model.dropout=0", "--set", "model.attn_dropout=0", "--set", "train.progress=false",
          "--set", "train.save_every=100"]


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data-dir", default="")
    a = ap.parse_args()
    out = Path(a.out)
    extra = ["--data-dir", a.data_dir] if a.data_dir else []
    one = [sys.executable, "-m", "mhe", *COMMON, *extra, "--out", str(out / "gpu1")]
    many = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.gpus}",
            "-m", "mhe", *COMMON, *extra, "--out", str(out / f"gpu{a.gpus}")]
    env1 = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    print("$", " ".join(one), flush=True)
    subprocess.run(one, check=True, env=env1)
    print("$", " ".join(many), flush=True)
    subprocess.run(many, check=True)
    a1, an = losses(out / "gpu1"), losses(out / f"gpu{a.gpus}")
    gaps = [abs(x - y) / abs(x) for x, y in zip(a1, an)]
    print(f"\n| step | 1 GPU loss | {a.gpus} GPU loss | rel. gap |\n|---:|---:|---:|---:|")
    for s in (1, 2, 5, 10, 25, 50, 100, 150, 200):
        if s <= len(a1):
            print(f"| {s} | {a1[s - 1]:.5f} | {an[s - 1]:.5f} | {gaps[s - 1]:.2e} |")
    r1 = json.loads((out / "gpu1" / "results.json").read_text())
    rn = json.loads((out / f"gpu{a.gpus}" / "results.json").read_text())
    print(f"\nsteps {len(a1)} vs {len(an)}; max rel. gap {max(gaps):.2e}, mean {sum(gaps) / len(gaps):.2e}; "
          f"test perplexity {r1['perplexity']:.2f} (1 GPU) vs {rn['perplexity']:.2f} ({a.gpus} GPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
