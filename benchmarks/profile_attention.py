"""Where the time of one attention sublayer goes: fwd+bwd timings and the top CUDA kernels.

    python benchmarks/profile_attention.py [--compile]

Compares MHA, MQA (native GQA and expanded K/V) and MHE-Mul/Add with both query folds,
at the GPT-2 sizes of the bench (B=16, T=1024, m=768, 12 heads, causal, bf16).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from mhe.attention import build_attention
from mhe.bench import timed

VARIANTS = [("mha", "mha", {}, "native"), ("mqa", "mqa", {}, "native"), ("mqa expand", "mqa", {}, "expand"),
            ("mhe-mul weight", "mhe-mul", {"query_fold": "weight"}, "native"),
            ("mhe-mul act", "mhe-mul", {"query_fold": "activation"}, "native"),
            ("mhe-mul act expand", "mhe-mul", {"query_fold": "activation"}, "expand"),
            ("mhe-add weight", "mhe-add", {"query_fold": "weight"}, "native"),
            ("mhe-add act", "mhe-add", {"query_fold": "activation"}, "native")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--top", type=int, default=6)
    a = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(16, 1024, 768, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn_like(x)
    table = []
    for label, kind, opts, mode in VARIANTS:
        kernel = "sdpa-expand" if mode == "expand" else "sdpa"
        mod = build_attention(kind, d_model=768, n_heads=12, causal=True, kernel=kernel, **opts).to(dev, dt)
        fn = torch.compile(mod) if a.compile else mod

        def step():
            fn(x).backward(g)

        ms = timed(step, warmup=10, reps=50, cuda=True)
        ms2 = timed(step, warmup=0, reps=50, cuda=True)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = [e for e in prof.key_averages() if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0]
        gpu_total = sum(getattr(e, "self_device_time_total", 0) for e in prof.key_averages()) / 5 / 1000
        cpu_total = prof.key_averages().total_average().cpu_time_total / 5 / 1000 if hasattr(prof.key_averages(), "total_average") else float("nan")
        n_kernels = sum(e.count for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0) // 5
        table.append((label, ms, ms2, gpu_total, n_kernels))
        print(f"\n== {label}: {ms:.3f} / {ms2:.3f} ms (two timings), GPU busy {gpu_total:.3f} ms, {n_kernels} kernels/step")
        top = sorted(prof.key_averages(), key=lambda e: -getattr(e, "self_device_time_total", 0))[: a.top]
        for e in top:
            print(f"   {getattr(e, 'self_device_time_total', 0) / 5 / 1000:7.3f} ms  x{e.count // 5:<3} {e.key[:90]}")
    print(f"\n| variant | fwd+bwd ms | again | GPU busy ms | kernels/step |\n|---|---:|---:|---:|---:|")
    for label, ms, ms2, busy, nk in table:
        print(f"| {label} | {ms:.3f} | {ms2:.3f} | {busy:.3f} | {nk} |")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; compile={a.compile}")


if __name__ == "__main__":
    main()
