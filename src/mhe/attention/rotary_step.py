"""One kernel for a decode step's attention input under rotary positions: its queries and keys
rotated by their positions and its keys stacked with its values, ready for the cache's one write.

At batch 1 a compiled step is its kernel count (about 2 us a launch of the replayed graph), and
inductor launches the queries' and keys' rotation, the stack of keys and values and the cache's
``index_copy_`` as three kernels a layer for MHA and four for GQA: inductor fuses pointwise work
over one iteration space, so it rotates queries and keys in one kernel only where they have as
many elements (MHA, not GQA: docs/benchmarks.md, "Why GQA launches one kernel a layer more").
:func:`rotate_step` does the rotations and the stack in one kernel that mutates nothing
(``mhe::rotary_step`` inside ``torch.compile``), so the cache's ``index_copy_`` of its stack
(:meth:`~mhe.attention.kv_cache.KVCache.write_stacked`) is the step's only other launch there.

It takes the fused Q/K/V product ``[B, 1, (h + 2 g) d]`` whole (:func:`split_product` makes the
views inside the operator): an earlier form took the product's three views, and inductor copied
each into a buffer of its own first (three kernels a layer on an H200; docs/benchmarks.md, "The
rotating step's first form added kernels"). Given the product whole, inductor hands over the
kernel's output that computes the RMSNorm and the product, with no copy, and every kind launches
281 kernels a token on llama-135m at batch 1 (docs/benchmarks.md, "The rotating step, given the
product whole"; ``decode.py step-code --rotary-step on`` shows the generated code); at 64 rows
GQA and MHE-Mul launch 309 and MHA 337, one operator-building kernel a layer more. Whether steps
use it is :data:`mhe.attention.kv_cache.ROTARY_STEP`, on by default (the sublayers that give a
product: ``Attention._step_product``).

The arithmetic is :class:`~mhe.attention.rotary.RotaryEmbedding`'s (its float32 tables cast to
the heads' dtype, ``x * cos + rotate_half(x) * sin`` over the first ``r`` dimensions, the rest
unchanged), carried in float32 (float64 for float64 input) and rounded once at the store, as
inductor's fused kernel does. It runs where :func:`step_fast_path` says: Triton on an Ampere or
newer card, or Triton's interpreter on CPU tensors (the tests); elsewhere the sublayer rotates
with the embedding and stacks with ``torch.stack``. (A keys-only form that rotated the keys as
the cache wrote them, ``kv_cache.ROTARY_WRITE``, measured slower on an H200 and was removed; the
last tree with it is commit 51b52df.)
"""

from __future__ import annotations

import contextlib
import functools

import torch

from mhe.attention.flash_decode import _flash_capable
from mhe.attention.triton_decode import interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # without Triton the step rotates with the embedding and stacks with torch.stack
    triton = tl = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_rotate_head_jit = None
""":func:`_rotate_head` compiled, set with the step kernel (:func:`_jitted_step`), which calls it."""


def _rotate_head(X, COS, SIN, pos, i, live, rotated, R: tl.constexpr, ACC: tl.constexpr):
    """One head's elements at ``X`` rotated by position ``pos`` (the first ``R`` of them), in ``ACC``:
    RotaryEmbedding's arithmetic, its float32 tables cast to the head's dtype first."""
    half = R // 2
    x = tl.load(X + i, mask=live, other=0.0).to(ACC)
    partner = tl.load(X + tl.where(i < half, i + half, i - half), mask=rotated, other=0.0).to(ACC)
    cos = tl.load(COS + pos * R + i, mask=rotated, other=1.0).to(X.dtype.element_ty).to(ACC)
    sin = tl.load(SIN + pos * R + i, mask=rotated, other=0.0).to(X.dtype.element_ty).to(ACC)
    return x * cos + tl.where(i < half, -partner, partner) * sin  # rotate_half: (-x2, x1)


def _rotate_step_kernel(Q, K, V, COS, SIN, POS, QO, KVO, NQ, H, sqb, sqh, skb, skh, svb, svh, spb, s_part,
                        R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """One program a (row, query or K/V head): a query head rotated into ``QO [B, NQ, 1, D]``, or a
    key head rotated and its value head copied into ``KVO [2, B, H, 1, D]``."""
    row = tl.program_id(0)
    b, h = (row // (NQ + H)).to(tl.int64), (row % (NQ + H)).to(tl.int64)
    i = tl.arange(0, BLOCK_D)
    live, rotated = i < D, i < R
    pos = tl.load(POS + b * spb)
    if h < NQ:
        out = _rotate_head_jit(Q + b * sqb + h * sqh, COS, SIN, pos, i, live, rotated, R, ACC)
        tl.store(QO + (b * NQ + h) * D + i, out.to(QO.dtype.element_ty), mask=live)
    else:
        hk = h - NQ
        out = _rotate_head_jit(K + b * skb + hk * skh, COS, SIN, pos, i, live, rotated, R, ACC)
        dst = KVO + (b * H + hk) * D + i
        tl.store(dst, out.to(KVO.dtype.element_ty), mask=live)
        value = tl.load(V + b * svb + hk * svh + i, mask=live, other=0.0)
        tl.store(dst + s_part, value.to(KVO.dtype.element_ty), mask=live)


@functools.cache
def _jitted_step(interpret: bool):
    """:func:`_rotate_step_kernel` compiled by Triton (or run by its interpreter), with its helper."""
    del interpret  # part of the cache key only
    global _rotate_head_jit
    _rotate_head_jit = triton.jit(_rotate_head)
    return triton.jit(_rotate_step_kernel)


def split_product(qkv: torch.Tensor, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    """The queries ``[B, heads, T, d]``, keys and values ``2 x [B, kv_heads, T, d]`` of a fused Q/K/V
    product ``[B, T, (heads + 2 kv_heads) d]``, as views (the sublayers' own split and head layout)."""
    b, t, width = qkv.shape
    d = width // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], -1)
    return tuple(part.view(b, t, n, d).transpose(1, 2) for part, n in ((q, heads), (k, kv_heads), (v, kv_heads)))


def step_fast_path(qkv: torch.Tensor, heads: int, kv_heads: int, positions: torch.Tensor) -> bool:
    """Whether :func:`rotate_step` runs its kernel: a product ``[B, 1, (heads + 2 kv_heads) d]`` of one
    new position in a dtype Triton takes, unit stride along it, a ``[B, 1]`` positions tensor, no
    autograd, on a card that takes Triton's kernels or in its interpreter."""
    here = (qkv.is_cuda and _flash_capable(qkv.device.index or 0)) or (qkv.device.type == "cpu" and interpreting())
    return (triton is not None and here and qkv.dtype in DTYPES and qkv.dim() == 3 and qkv.shape[1] == 1
            and qkv.shape[2] % (heads + 2 * kv_heads) == 0 and qkv.stride(-1) == 1
            and positions.dim() == 2 and positions.shape == (qkv.shape[0], 1)
            and not (torch.is_grad_enabled() and qkv.requires_grad))


def launch_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The step kernel on ``q: [B, n, 1, d]``, ``k, v: [B, g, 1, d]`` (any strides with the last
    one 1) and ``positions: [B, 1]``: the rotated queries ``[B, n, 1, d]`` and the rotated keys
    stacked with the values, ``[2, B, g, 1, d]``."""
    b, n, _, d = q.shape
    g = k.shape[1]
    q_out = torch.empty(b, n, 1, d, dtype=q.dtype, device=q.device)
    kv_out = torch.empty(2, b, g, 1, d, dtype=k.dtype, device=k.device)
    acc = tl.float64 if k.dtype == torch.float64 else tl.float32
    kernel = _jitted_step(interpreting())
    with torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext():
        kernel[(b * (n + g),)](q, k, v, cos, sin, positions, q_out, kv_out, n, g, q.stride(0), q.stride(1),
                               k.stride(0), k.stride(1), v.stride(0), v.stride(1), positions.stride(0),
                               kv_out.stride(0), R=cos.shape[-1], D=d, BLOCK_D=max(16, 1 << (d - 1).bit_length()),
                               ACC=acc, num_warps=1)
    return q_out, kv_out


@torch.library.custom_op("mhe::rotary_step", mutates_args=())
def rotary_step(qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`launch_step` on the fused product's views, as one operator that ``torch.compile``
    keeps whole. It takes the product itself, not its views, which inductor copied before an
    earlier form of it (see the module docstring)."""
    return launch_step(*split_product(qkv, heads, kv_heads), cos, sin, positions)


@rotary_step.register_fake
def _(qkv, heads, kv_heads, cos, sin, positions):
    b, d = qkv.shape[0], qkv.shape[2] // (heads + 2 * kv_heads)
    return qkv.new_empty(b, heads, 1, d), qkv.new_empty(2, b, kv_heads, 1, d)


def rotate_step(qkv: torch.Tensor, heads: int, kv_heads: int, rotary,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For a fused product ``qkv`` of ``heads`` query and ``kv_heads`` K/V heads (:func:`split_product`),
    ``rotary(q, positions)`` and ``stack((rotary(k, positions), v))`` in one kernel
    (:func:`step_fast_path` must hold): the step's queries and what its cache writes."""
    cos, sin = rotary.table(qkv.device)
    if torch.compiler.is_compiling():
        return torch.ops.mhe.rotary_step(qkv, heads, kv_heads, cos, sin, positions)
    return launch_step(*split_product(qkv, heads, kv_heads), cos, sin, positions)
