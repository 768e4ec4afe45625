"""A decode step compiled with extra inductor options against the eager step, on a GPU.

    python benchmarks/decode_options_check.py [--options coordinate]

Builds the tiny decoder (MHA and MHE-Mul, fp32, random weights), generates 16 greedy tokens
eagerly and through ``model.generate`` with ``step_mode="compile"`` and the named
``compile_options`` (``coordinate``: ``{"options": {"coordinate_descent_tuning": True}}``), at
batch 1 and 3, and prints whether the tokens are equal and the largest logit difference; exits 1
if the tokens differ or a logit differs by 1e-4 or more (inductor's fp32 arithmetic differs from
eager's in rounding only). Checks an option before ``decode_fusion.py`` times it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=OTHER/src runs another tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mhe.models import build_model  # noqa: E402

OPTIONS = {"coordinate": {"options": {"coordinate_descent_tuning": True}},
           "combo": {"options": {"combo_kernels": True}}}


def check(name: str) -> bool:
    ok = True
    for kind in ("mha", "mhe-mul"):
        torch.manual_seed(0)
        model = build_model("tiny-decoder", attention=kind, dropout=0.0, attn_dropout=0.0).cuda().float().eval()
        for batch in (1, 3):
            ids = torch.randint(3, 1024, (batch, 9), device="cuda")
            want, wl = model.generate(ids, 16, step_mode="eager", return_logits=True)
            session = model.generator(batch, 30, step_mode="compile", compile_options=OPTIONS[name])
            got, gl = model.generate(ids, 16, session=session, return_logits=True)
            err = (gl - wl).abs().max().item()
            same = torch.equal(got, want)
            print(f"{kind} batch {batch}: tokens equal {same}; max |logit diff| {err:.2e}", flush=True)
            ok = ok and same and err < 1e-4
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--options", default="coordinate", choices=sorted(OPTIONS))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("decode_options_check.py: needs a CUDA device", file=sys.stderr)
        return 2
    ok = check(a.options)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
