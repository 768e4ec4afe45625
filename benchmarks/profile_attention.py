"""Where the time of one attention sublayer goes: fwd+bwd timings and the top CUDA kernels.

    python benchmarks/profile_attention.py --compile [--variants all]

Compares MQA and MHE-Mul with both query folds by default (``--variants all`` adds MHA, MQA
with expanded K/V and MHE-Add), at the GPT-2 sizes of the bench (B=16, T=1024, m=768, 12 heads, causal, bf16). For each
variant: fwd+bwd time (two timings), GPU busy time, kernels per step, the top CUDA kernels
with their share of GPU time, and with ``--compile`` the graphs dynamo built, its graph breaks
and recompiles (dynamo is reset before each variant, so no variant inherits another's cache).
It ends with each variant's extra GPU time over MQA kernel by kernel: what makes, say, the
compiled MHE-Mul sublayer slower than MQA (the query-weight building, its gradient, the
output scaling) is read off that table.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from mhe.attention import build_attention
from mhe.bench import timed

VARIANTS = {"mha": ("mha", {}, "native"), "mqa": ("mqa", {}, "native"), "mqa-expand": ("mqa", {}, "expand"),
            "mhe-mul-weight": ("mhe-mul", {"query_fold": "weight"}, "native"),
            "mhe-mul-act": ("mhe-mul", {"query_fold": "activation"}, "native"),
            "mhe-mul-act-expand": ("mhe-mul", {"query_fold": "activation"}, "expand"),
            "mhe-add-weight": ("mhe-add", {"query_fold": "weight"}, "native"),
            "mhe-add-act": ("mhe-add", {"query_fold": "activation"}, "native")}
DEFAULT_VARIANTS = "mqa,mhe-mul-weight,mhe-mul-act"
PROFILED_STEPS = 5


def kernel_times(prof) -> dict[str, tuple[float, int]]:
    """CUDA kernel name -> (ms per step, launches per step)."""
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0)
        if t > 0 and e.device_type.name == "CUDA":
            out[e.key] = (t / PROFILED_STEPS / 1000, e.count // PROFILED_STEPS)
    return out


def dynamo_stats() -> dict[str, int]:
    c = torch._dynamo.utils.counters
    frames = int(c["frames"]["total"])
    return {"graphs": int(c["stats"]["unique_graphs"]), "graph_breaks": int(sum(c["graph_break"].values())),
            "recompiles": max(frames - 1, 0)}  # one frame expected: every call runs fwd+bwd under grad


def profile_variant(label: str, *, compile_model: bool, x, g, top: int) -> dict:
    kind, opts, mode = VARIANTS[label]
    kernel = "sdpa-expand" if mode == "expand" else "sdpa"
    mod = build_attention(kind, d_model=768, n_heads=12, causal=True, kernel=kernel, **opts).to(x.device, x.dtype)
    if compile_model:
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    fn = torch.compile(mod) if compile_model else mod

    def step():
        fn(x).backward(g)

    ms = timed(step, warmup=10, reps=50, cuda=True)
    ms2 = timed(step, warmup=0, reps=50, cuda=True)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(PROFILED_STEPS):
            step()
        torch.cuda.synchronize()
    kt = kernel_times(prof)
    busy = sum(t for t, _ in kt.values())
    row = {"label": label, "ms": ms, "ms2": ms2, "busy": busy, "launches": sum(n for _, n in kt.values()),
           "kernels": kt, **(dynamo_stats() if compile_model else {})}
    dyn = (f", dynamo: {row['graphs']} graphs, {row['graph_breaks']} graph breaks, {row['recompiles']} recompiles"
           if compile_model else "")
    print(f"\n== {label}: fwd+bwd {ms:.3f} / {ms2:.3f} ms (two timings), GPU busy {busy:.3f} ms, "
          f"{row['launches']} kernels/step{dyn}")
    for name, (t, n) in sorted(kt.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"   {t:7.3f} ms {100 * t / busy:5.1f}%  x{n:<3} {name[:100]}")
    return row


def extra_over(row: dict, ref: dict, top: int) -> None:
    """``row``'s GPU time minus ``ref``'s, kernel by kernel (same names compared)."""
    diff = defaultdict(float)
    for name, (t, _) in row["kernels"].items():
        diff[name] += t
    for name, (t, _) in ref["kernels"].items():
        diff[name] -= t
    total = row["busy"] - ref["busy"]
    print(f"\n-- {row['label']} minus {ref['label']}: wall {row['ms'] - ref['ms']:+.3f} ms, "
          f"GPU busy {total:+.3f} ms; largest differences:")
    for name, t in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:top]:
        print(f"   {t:+7.3f} ms  {name[:100]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--variants", default=DEFAULT_VARIANTS,
                    help=f"comma-separated, from {', '.join(VARIANTS)}; or all (default {DEFAULT_VARIANTS})")
    a = ap.parse_args()
    labels = list(VARIANTS) if a.variants == "all" else [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in labels if v not in VARIANTS]
    if bad:
        raise SystemExit(f"unknown variant {bad[0]!r}; valid: {', '.join(VARIANTS)}")
    dev, dt = torch.device("cuda"), torch.bfloat16
    x = torch.randn(16, 1024, 768, device=dev, dtype=dt, requires_grad=True)
    g = torch.randn_like(x)
    rows = [profile_variant(v, compile_model=a.compile, x=x, g=g, top=a.top) for v in labels]
    by = {r["label"]: r for r in rows}
    if "mqa" in by:
        for r in rows:
            if r["label"] != "mqa":
                extra_over(r, by["mqa"], a.top)
    dyn = a.compile
    print("\n| variant | fwd+bwd ms | again | vs MQA | GPU busy ms | kernels/step |"
          + (" graphs | breaks | recompiles |" if dyn else ""))
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if dyn else ""))
    for r in rows:
        vs = f"{r['ms'] / by['mqa']['ms']:.2f}" if "mqa" in by else "-"
        extra = f" {r['graphs']} | {r['graph_breaks']} | {r['recompiles']} |" if dyn else ""
        print(f"| {r['label']} | {r['ms']:.3f} | {r['ms2']:.3f} | {vs} | {r['busy']:.3f} | {r['launches']} |{extra}")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; compile={a.compile}")


if __name__ == "__main__":
    main()
