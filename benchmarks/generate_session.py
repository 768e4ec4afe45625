"""What a held generation session saves: ``model.generate`` with a new session per call (the
default) against one session passed to every call (``model.generator(batch, max_len)``).

    python benchmarks/generate_session.py [--preset gpt2-base] [--kinds mha,mhe-mul] [--batch 1]
                                          [--prompt 256] [--new 256] [--reps 5] [--json out.json]

Random weights, greedy, no stop token, in bf16 on a GPU (fp32 on a CPU), timed from the call to its
return (prefill included, CUDA synchronised); median of ``--reps`` calls after one warm-up call.
A new session builds the inference view (MHE folded), allocates the caches and, on a GPU,
captures the decode step as a CUDA graph again; a held one does that once.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mhe.models import build_model


def median_seconds(fn, reps: int, cuda: bool) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt2-base")
    ap.add_argument("--kinds", default="mha,mhe-mul")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    card = torch.cuda.get_device_name(dev) if cuda else "CPU"
    rows = []
    for kind in a.kinds.split(","):
        torch.manual_seed(0)
        model = build_model(a.preset, attention=kind, max_len=a.prompt + a.new, dropout=0.0,
                            attn_dropout=0.0).to(dev, dtype).eval()
        ids = torch.randint(0, model.cfg.vocab_size, (a.batch, a.prompt), device=dev)
        session = model.generator(a.batch, a.prompt + a.new)
        held = median_seconds(lambda: model.generate(ids, a.new, session=session), a.reps, cuda)
        del session
        fresh = median_seconds(lambda: model.generate(ids, a.new), a.reps, cuda)
        rows.append({"kind": kind, "held_ms_per_token": 1000 * held / a.new,
                     "fresh_ms_per_token": 1000 * fresh / a.new, "fresh_over_held": fresh / held})
        del model
    print(f"\n{a.preset}, batch {a.batch}, prompt {a.prompt} + {a.new} new, {str(dtype).split('.')[-1]}, {card}")
    print("| kind | held session ms/token | new session per call ms/token | new / held |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['held_ms_per_token']:.3f} | {r['fresh_ms_per_token']:.3f} | "
              f"{r['fresh_over_held']:.2f}x |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"card": card, "args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
