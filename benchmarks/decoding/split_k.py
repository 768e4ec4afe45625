"""The ``split-k-decode`` kernel alone: correctness against SDPA and the rate it reads the cache.

    python benchmarks/decode.py split-k [--batch 64] [--context 4096] [--reps 50] [--json out.json] [--sweep]

For llama-135m's and llama-1.1b's attention shapes (9 and 32 query heads of 64) with MQA, GQA
(3 and 4 K/V heads) and MHA K/V heads, bf16, a full cache of ``--context`` positions per row:
the max |difference| from SDPA's fp32 output on the same bf16 inputs (and, at a small shape,
fp32 against fp32 SDPA, which the kernel must match to 1e-5), then one decode step's attention
timed as CUDA-graph replays (``mhe.bench.common.timed``) for ``split-k-decode``, ``sdpa`` (the
dense mask generation would hand it) and, for one K/V head, ``flash-decode``. The rate is the K/V
bytes read / the step time, and its fraction of the card's copy bandwidth (a 1 GiB
device-to-device copy, bytes read plus written). ``--sweep`` then times ``split-k-decode`` on the
MQA and GQA shapes under other launch settings (``triton_decode.TILE``: positions per loop step,
warps, pipelining stages; ``PROGRAMS_PER_SM``). Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F

from mhe.attention.masks import AttentionMask
from mhe.attention import masks, triton_decode
from mhe.attention.flash_decode import range_mask
from mhe.attention.kernels import attend
from mhe.bench.common import timed

SHAPES = [("llama-135m", "mqa", 9, 1), ("llama-135m", "gqa", 9, 3), ("llama-135m", "mha", 9, 9),
          ("llama-1.1b", "mqa", 32, 1), ("llama-1.1b", "gqa", 32, 4), ("llama-1.1b", "mha", 32, 32)]
HEAD_DIM = 64


def copy_bandwidth(reps: int = 20) -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read plus written)."""
    src = torch.empty(2 ** 29, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), warmup=3, reps=reps, cuda=True)
    return 2 * src.numel() * src.element_size() / (ms / 1e3)


def inputs(b, hq, hk, s, dtype, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, 1, hq, HEAD_DIM, device="cuda", dtype=dtype).transpose(1, 2)  # [B, h_q, 1, d]
    kv = torch.randn(2, b, hk, s, HEAD_DIM, device="cuda", dtype=dtype)
    key_range = masks.decode_key_range(None, torch.tensor(s - 1, device="cuda"), s, batch=b,
                                       device=torch.device("cuda"))
    return q, kv[0], kv[1], key_range


def fp32_error() -> float:
    """Max |split-k-decode - SDPA| in fp32 over a ragged small case (must be <= 1e-5)."""
    q, k, v, _ = inputs(4, 12, 3, 1000, torch.float32, seed=1)
    key_mask = torch.arange(1000, device="cuda")[None, :] >= torch.tensor([0, 17, 300, 990], device="cuda")[:, None]
    kr = masks.decode_key_range(key_mask, torch.tensor(999, device="cuda"), 1000, batch=4, device=torch.device("cuda"))
    got = triton_decode.launch(q, k, v, kr[0], kr[1], 1 / math.sqrt(HEAD_DIM))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=range_mask(kr, 1000), enable_gqa=True)
    return (got - want).abs().max().item()


def row(preset, kind, hq, hk, *, batch, context, reps, bandwidth) -> dict:
    q, k, v, kr = inputs(batch, hq, hk, context, torch.bfloat16)
    dense = range_mask(kr, context)
    got = attend(q, k, v, AttentionMask(key_range=kr), kernel="split-k-decode")
    gold = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    plain = attend(q, k, v, AttentionMask(dense=dense), kernel="sdpa")
    nbytes = 2 * k.numel() * k.element_size()
    out = {"preset": preset, "kind": kind, "batch": batch, "context": context, "h_q": hq, "h_kv": hk,
           "kv_bytes": nbytes, "max_err_split_k": (got.float() - gold).abs().max().item(),
           "max_err_sdpa": (plain.float() - gold).abs().max().item()}
    calls = kernel_calls(q, hk)
    for name, call in calls.items():
        ms = timed(lambda: call(k, v, kr, dense), warmup=5, reps=reps, cuda=True, graph=True)
        out[f"{name}_ms"] = round(ms, 4)
        out[f"{name}_fraction_of_bandwidth"] = round(nbytes / (ms / 1e3) / bandwidth, 3)
    out.update(layered(q, hk, batch=batch, context=context, reps=reps, bandwidth=bandwidth, calls=calls))
    out["splits"] = triton_decode.choose_splits(batch * hk, context,
                                                torch.cuda.get_device_properties(0).multi_processor_count)
    return out


def kernel_calls(q, hk) -> dict:
    """The kernels compared, each a call on ``(k, v, key_range, dense mask)``: ``split-k-decode``
    (its fused merge), ``split-k-two-kernels`` (the separate merge kernel), ``sdpa`` with the dense
    mask, and, for one K/V head, ``flash-decode``."""
    scale = 1 / math.sqrt(q.shape[-1])
    calls = {"split-k-decode": lambda k, v, kr, dense: attend(q, k, v, AttentionMask(key_range=kr),
                                                               kernel="split-k-decode"),
             "split-k-two-kernels": lambda k, v, kr, dense: triton_decode.launch(q, k, v, kr[0], kr[1], scale,
                                                                                 fused=False),
             "sdpa": lambda k, v, kr, dense: attend(q, k, v, AttentionMask(dense=dense), kernel="sdpa")}
    if hk == 1:
        calls["flash-decode"] = lambda k, v, kr, dense: attend(q, k, v, AttentionMask(key_range=kr),
                                                               kernel="flash-decode")
    return calls


def layered(q, hk, *, batch, context, reps, bandwidth, calls) -> dict:
    """Each kernel as a decode step runs it: one graph of ``n`` calls over ``n`` distinct caches
    (a model's layers; up to 30, about 4 GiB of caches), timed whole and divided by ``n``. A
    graph of one call, as :func:`row` times, also pays the graph's launch and the events around
    it, which a step of many layers pays once."""
    _, hq, _, d = q.shape
    nbytes = 2 * batch * hk * context * d * q.element_size()
    n = max(2, min(30, (4 << 30) // nbytes))
    caches = [inputs(batch, hq, hk, context, q.dtype, seed=i + 1)[1:] for i in range(n)]
    caches = [(k, v, kr, range_mask(kr, context)) for k, v, kr in caches]
    out = {"layers": n}
    for name, call in calls.items():
        def step(call=call):
            for cache in caches:
                call(*cache)
        ms = timed(step, warmup=3, reps=reps, cuda=True, graph=True) / n
        out[f"{name}_layer_ms"] = round(ms, 4)
        out[f"{name}_layer_fraction_of_bandwidth"] = round(nbytes / (ms / 1e3) / bandwidth, 3)
    del caches
    return out


SWEEP = [dict(block_n=bn, num_warps=w, num_stages=st, programs=pp)
         for bn, w in ((32, 4), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8))
         for st in (2, 3, 4) for pp in (2, 4, 8)]


def sweep(*, batch, context, reps, bandwidth) -> list[dict]:
    """``split-k-decode``'s step time on the MQA and GQA shapes under each launch setting of
    :data:`SWEEP` (the module's settings put back after)."""
    saved, saved_pp = dict(triton_decode.TILE), triton_decode.PROGRAMS_PER_SM
    cases = [(p, k, hq, hk) for p, k, hq, hk in SHAPES if k != "mha"]
    data = {c: inputs(batch, c[2], c[3], context, torch.bfloat16) for c in cases}
    out = []
    try:
        for setting in SWEEP:
            triton_decode.TILE.update({k: setting[k] for k in ("block_n", "num_warps", "num_stages")})
            triton_decode.PROGRAMS_PER_SM = setting["programs"]
            for (preset, kind, hq, hk), (q, k, v, kr) in data.items():
                ms = timed(lambda: attend(q, k, v, AttentionMask(key_range=kr), kernel="split-k-decode"), warmup=3, reps=reps,
                           cuda=True, graph=True)
                frac = 2 * k.numel() * k.element_size() / (ms / 1e3) / bandwidth
                out.append({**setting, "preset": preset, "kind": kind, "ms": round(ms, 4), "fraction": round(frac, 3)})
    finally:
        triton_decode.TILE.update(saved)
        triton_decode.PROGRAMS_PER_SM = saved_pp
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py split-k", description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time 54 other launch settings (about two minutes)")
    args = ap.parse_args(argv)
    bw = copy_bandwidth()
    err = fp32_error()
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.2f} TB/s; fp32 max |split-k - sdpa| "
          f"{err:.2e} ({'ok' if err <= 1e-5 else 'FAILS 1e-5'})")
    rows = [row(*shape, batch=args.batch, context=args.context, reps=args.reps, bandwidth=bw) for shape in SHAPES]
    for r in rows:
        times = "  ".join(f"{n} {r[f'{n}_ms']:.4f} ms ({r[f'{n}_fraction_of_bandwidth']:.0%}; in {r['layers']} "
                          f"layers {r[f'{n}_layer_ms']:.4f} ms, {r[f'{n}_layer_fraction_of_bandwidth']:.0%})"
                          for n in ("split-k-decode", "split-k-two-kernels", "flash-decode", "sdpa") if f"{n}_ms" in r)
        print(f"{r['preset']:<11} {r['kind']:<4} B={r['batch']} S={r['context']} splits={r['splits']:<3} "
              f"{r['kv_bytes'] / 2 ** 20:8.1f} MiB  err {r['max_err_split_k']:.1e} (sdpa {r['max_err_sdpa']:.1e})"
              f"  {times}")
    swept = sweep(batch=args.batch, context=args.context, reps=min(args.reps, 20), bandwidth=bw) if args.sweep else []
    if swept:
        mean = {}
        for r in swept:
            mean.setdefault(tuple(r[k] for k in ("block_n", "num_warps", "num_stages", "programs")), []).append(
                r["fraction"])
        best = sorted(mean.items(), key=lambda kv: -sum(kv[1]) / len(kv[1]))[:8]
        print("sweep (block_n, warps, stages, programs per SM): mean fraction of bandwidth over MQA and GQA")
        for key, fr in best:
            print(f"  {key}: {sum(fr) / len(fr):.3f}  ({', '.join(f'{x:.2f}' for x in fr)})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(0), "copy_bandwidth": bw, "fp32_max_err": err,
                       "rows": rows, "sweep": swept}, f, indent=1)

