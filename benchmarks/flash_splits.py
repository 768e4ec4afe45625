"""Does ``flash-decode`` read a one-head cache faster with its keys split over more thread blocks?

    python benchmarks/flash_splits.py [--batch 64] [--context 4096] [--reps 50] [--json out.json]

A decode step of MQA or folded MHE at batch 64 x 4,096 (one K/V head of 64, 12 query heads,
bf16) read its 64 MiB cache at about 0.9 TB/s through ``flash-decode`` (docs/benchmarks.md
section 5), a third of the card's bandwidth: FlashAttention-2's split heuristic gives the 64
rows few splits. This measures, as CUDA-graph replays (median of ``--reps``), on one filled cache:

* ``flash-decode`` as generation runs it (the kernel's own heuristic);
* ``num_splits`` forced to 2-32, where this torch's ``aten._flash_attention_forward`` takes it;
* the keys split by hand into s runs per row: B*s one-query problems in one variable-length call,
  merged by their log-sum-exps (the layout of the returned log-sum-exp is read off the
  agreement: both candidate layouts are tried and the closer one reported);

each with the cache's read rate and its largest difference from ``flash-decode``. It changes
nothing in the library; a variant that wins by a wide margin is the next step for the
64 x 4,096 target. Needs a CUDA GPU (Ampere or newer).
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from mhe.attention.flash_decode import flash_decode_kernel
from mhe.attention.masks import decode_key_range
from mhe.bench import timed


def _takes(name: str) -> bool:
    return any(a.name == name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments)


def forced(q, k, v, splits: int):
    """flash-decode's call with ``num_splits`` given."""
    b, h, _, d = q.shape
    s = k.shape[2]
    cum_q = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    cum_k = torch.arange(0, (b + 1) * s, s, device=q.device, dtype=torch.int32)
    used = torch.full((b,), s, device=q.device, dtype=torch.int32)
    return torch.ops.aten._flash_attention_forward(
        q.reshape(b, h, d), k.view(b * s, 1, d), v.view(b * s, 1, d), cum_q, cum_k, 1, s, 0.0, False, False,
        scale=1.0 / math.sqrt(d), seqused_k=used, num_splits=splits)[0].reshape(b, h, 1, d)


def by_hand(q, k, v, pieces: int, layout: str):
    """Each row's keys as ``pieces`` runs, one problem each, merged by log-sum-exp."""
    b, h, _, d = q.shape
    s = k.shape[2]
    chunk = -(-s // pieces)
    j = torch.arange(pieces, device=q.device, dtype=torch.int32)
    starts = (torch.arange(b, device=q.device, dtype=torch.int32)[:, None] * s + j * chunk).reshape(-1)  # [B*p]
    used = (s - j * chunk).clamp(0, chunk).repeat(b)  # [B*p]
    cum_k = torch.cat([starts, torch.full((1,), b * s, device=q.device, dtype=torch.int32)])
    cum_q = torch.arange(b * pieces + 1, device=q.device, dtype=torch.int32)
    rows = q.reshape(b, 1, h, d).expand(b, pieces, h, d).reshape(b * pieces, h, d)
    out, lse = torch.ops.aten._flash_attention_forward(
        rows, k.view(b * s, 1, d), v.view(b * s, 1, d), cum_q, cum_k, 1, chunk, 0.0, False, False,
        scale=1.0 / math.sqrt(d), seqused_k=used)[:2]
    lse = lse.reshape(h, b * pieces).t() if layout == "heads first" else lse.reshape(b * pieces, h)
    lse = lse.reshape(b, pieces, h).float()
    w = torch.exp(lse - lse.max(1, keepdim=True).values)  # [B, p, h]
    out = out.reshape(b, pieces, h, d).float()
    return ((w[..., None] * out).sum(1) / w.sum(1)[..., None]).to(q.dtype).reshape(b, h, 1, d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flash_splits.py needs a CUDA GPU")
    torch.manual_seed(0)
    b, s, h, d = a.batch, a.context, 12, 64
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 1, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    key_range = decode_key_range(None, s - 1, s, batch=b, device=q.device)
    variants = {"flash-decode (heuristic)": lambda: flash_decode_kernel(q, k, v, mask=None, is_causal=False,
                                                                        dropout_p=0.0, scale=None, key_range=key_range)}
    if _takes("num_splits"):
        variants.update({f"num_splits={n}": (lambda n=n: forced(q, k, v, n)) for n in (2, 4, 8, 16, 32)})
    for p in (2, 4, 8, 16):
        for layout in ("heads first", "rows first"):
            variants[f"by hand, {p} runs ({layout})"] = lambda p=p, layout=layout: by_hand(q, k, v, p, layout)
    ref = variants["flash-decode (heuristic)"]().float()
    nbytes = 2 * k.numel() * k.element_size()
    rows = []
    for name, fn in variants.items():
        try:
            diff = (fn().float() - ref).abs().max().item()
            ms = timed(fn, warmup=5, reps=a.reps, cuda=True, graph=True)
            rows.append({"variant": name, "ms": ms, "gb_per_s": nbytes / ms / 1e6, "max_abs_diff": diff})
        except Exception as e:  # noqa: BLE001  a variant this torch cannot run
            rows.append({"variant": name, "error": repr(e)[:200]})
    card = torch.cuda.get_device_name()
    print(f"\none-head decode attention, batch {b}, context {s:,}, 12 query heads of 64, bf16; {card}, "
          f"torch {torch.__version__}\n\n| variant | ms | cache GB/s | max abs diff |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['variant']} | " + (f"{r['ms']:.4f} | {r['gb_per_s']:,.0f} | {r['max_abs_diff']:.2e} |"
                                        if "error" not in r else f"failed: {r['error']} | | |"))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": card, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
