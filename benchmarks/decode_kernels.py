"""One-token decoding per attention kernel: sdpa, matmul-decode and flash-decode, side by side.

    python benchmarks/decode_kernels.py [--reps 50] [--json decode-kernels.json]

For (batch 64, context 4096) and (batch 1, context 1024), MHA, MQA and MHE-Mul (folded to
MQA, as generation runs it), GPT-2 sizes (m = 768, 12 heads of 64), bf16, times as CUDA-graph
replays (the helpers of ``mhe bench --sections decode``): one attention sublayer, and the whole
gpt2-base model. Prints the step time, the rate the filled K/V cache is read at (cache bytes /
step time), and the ratio to MHA under ``sdpa``. Then checks ``flash-decode`` against ``sdpa``
on the same sublayer and cache: a full cache, and a half-filled one under left padding of a
different length per row (max abs difference, bf16). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from mhe.attention import build_attention
from mhe.attention.folding import fold_mhe
from mhe.bench import bench_decode, bench_decode_attention
from mhe.experiments.tables import print_table
from mhe.training.checkpoint import write_json_atomic

SETTINGS = [(64, 4096), (1, 1024)]
KINDS = ["mha", "mqa", "mhe-mul"]
KERNELS = ["sdpa", "matmul-decode", "flash-decode"]


def timings(reps: int, dev, dtype) -> list[dict]:
    rows = []
    for kernel in KERNELS:
        for r in bench_decode_attention(KINDS, SETTINGS, dev=dev, dtype=dtype, m=768, n=12, warmup=10, reps=reps,
                                        graphs=True, kernel=kernel):
            rows.append({**r, "what": "sublayer", "asked": kernel})
        for r in bench_decode(KINDS, SETTINGS, dev=dev, dtype=dtype, warmup=10, reps=reps, small=False, graphs=True,
                              kernel=kernel):
            rows.append({**r, "what": "model", "asked": kernel, "kv_cache_bytes": r["kv_cache_bytes_total"]})
    for r in rows:
        r["cache_gb_per_s"] = r["kv_cache_bytes"] / r["step_ms"] / 1e6
    return rows


def agreement(kind: str, dev, dtype, *, batch: int = 8, ctx: int = 1024) -> dict:
    """Max |flash-decode - sdpa| on one sublayer's decode step, full and left-padded caches."""
    torch.manual_seed(0)
    mod = build_attention(kind, d_model=768, n_heads=12, causal=True).to(dev, dtype).eval()
    mod = fold_mhe(mod) if kind.startswith("mhe-") else mod
    cache = mod.new_cache(batch, ctx + 1)
    cache.k.normal_()
    cache.v.normal_()
    x = torch.randn(batch, 1, 768, device=dev, dtype=dtype)
    pad = torch.randint(0, ctx // 4, (batch,), device=dev)  # [B] left padding per row
    key_mask = torch.arange(ctx + 1, device=dev)[None, :] >= pad[:, None]  # [B, L]
    out = {}
    for case, pos, mask in (("full", ctx, None), ("left-padded, half filled", ctx // 2, key_mask)):
        res = {}
        for kernel in ("sdpa", "flash-decode"):
            mod.cfg = dataclasses.replace(mod.cfg, kernel=kernel)
            cache.index.fill_(pos)
            with torch.no_grad():
                res[kernel] = mod(x, mask=mask, cache=cache).float()
        out[case] = (res["flash-decode"] - res["sdpa"]).abs().max().item()
    out["output scale"] = res["sdpa"].abs().max().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernels.py needs a CUDA GPU")
    dev, dtype = torch.device("cuda"), torch.bfloat16
    card = torch.cuda.get_device_name(dev)
    print(f"device: {card}; torch {torch.__version__}; bf16; CUDA-graph replays, median of {a.reps}")
    rows = timings(a.reps, dev, dtype)
    base = {(r["what"], r["batch"]): r["step_ms"] for r in rows if r["kind"] == "mha" and r["asked"] == "sdpa"}
    for what in ("sublayer", "model"):
        print(f"\none-token decode step, {'one attention sublayer (m=768, 12 heads)' if what == 'sublayer' else 'whole gpt2-base model'}")
        print_table(["batch", "context", "kind", "kernel", "step ms", "cache GB/s", "MHA-sdpa / this"],
                    [[r["batch"], r["context"], r["kind"], r["kernel"], f"{r['step_ms']:.4f}",
                      f"{r['cache_gb_per_s']:,.0f}", f"{base[(what, r['batch'])] / r['step_ms']:.2f}x"]
                     for r in sorted((r for r in rows if r["what"] == what),
                                     key=lambda r: (-r["batch"], KINDS.index(r["kind"]), KERNELS.index(r["asked"])))])
    print("(MHA has 12 K/V heads: matmul-decode and flash-decode run sdpa for it, so its rows repeat sdpa's.)")
    checks = {kind: agreement(kind, dev, dtype) for kind in ("mqa", "mhe-mul")}
    print("\nflash-decode against sdpa, one sublayer, batch 8, context 1024, bf16 (max abs difference):")
    print_table(["kind", "full cache", "left-padded, half filled", "max |output|"],
                [[k, f"{c['full']:.2e}", f"{c['left-padded, half filled']:.2e}", f"{c['output scale']:.2f}"]
                 for k, c in checks.items()])
    print(f"device: {card}")
    if a.json:
        write_json_atomic(a.json, {"device": card, "torch": torch.__version__, "rows": rows, "agreement": checks})


if __name__ == "__main__":
    main()
