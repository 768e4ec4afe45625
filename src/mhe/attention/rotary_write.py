"""One kernel for a decode step's new keys: rotated by their positions and written into the cache
with their values.

At batch 1 a compiled step launches the keys' rotary, the ``[2, B, h, 1, d]`` stack of keys and
values and the cache's ``index_copy_`` as two kernels a layer (three for grouped keys, written
transposed first; docs/benchmarks.md, "Kernels a layer"), each about 1 us of work and a launch
slot of the replayed graph. :func:`write` does it in one: on ``kv: [2, B, h, L, d]`` (a
:class:`~mhe.attention.kv_cache.KVCache` buffer), its write position ``index`` (0-d long, read on
the device, so the step stays one CUDA graph), the unrotated keys ``k`` and values ``v`` ``[B, h,
1, d]`` (any strides with the last one 1: the split of the fused Q/K/V product) and the positions
``[B, 1]``, it sets ``kv[0, :, :, index] = rotary(k, positions)`` and ``kv[1, :, :, index] = v``.

The arithmetic is :class:`~mhe.attention.rotary.RotaryEmbedding`'s (its float32 tables cast to
the keys' dtype, ``k * cos + rotate_half(k) * sin`` over the first ``r`` dimensions, the rest
unchanged), carried in float32 (float64 for float64 keys) and rounded once at the store, as
inductor's fused kernel does. Inside ``torch.compile`` it is one opaque operator
(``mhe::rotary_cache_write``, mutating ``kv``). It runs where :func:`fast_path` says: Triton on
an Ampere or newer card, or Triton's interpreter on CPU tensors (the tests); a cache asked to
rotate elsewhere rotates with the embedding and writes as before
(:meth:`~mhe.attention.kv_cache.KVCache.update`). Whether caches are asked at all is
:data:`mhe.attention.kv_cache.ROTARY_WRITE`.
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
except ImportError:  # without Triton the cache rotates and writes as two operations
    triton = tl = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _rotary_write_kernel(K, V, COS, SIN, POS, INDEX, KV, H, skb, skh, svb, svh, spb, s_part, s_b, s_h, s_l,
                         R: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, ACC: tl.constexpr):
    """One program a (row, K/V head): the rotated key and the value into the cache at ``INDEX``."""
    row = tl.program_id(0)
    b, h = (row // H).to(tl.int64), (row % H).to(tl.int64)  # int64: a large cache's offsets pass 2**31
    i = tl.arange(0, BLOCK_D)
    live = i < D
    rotated = i < R
    half = R // 2
    key = K + b * skb + h * skh
    k = tl.load(key + i, mask=live, other=0.0).to(ACC)
    partner = tl.load(key + tl.where(i < half, i + half, i - half), mask=rotated, other=0.0).to(ACC)
    pos = tl.load(POS + b * spb)
    cos = tl.load(COS + pos * R + i, mask=rotated, other=1.0).to(K.dtype.element_ty).to(ACC)
    sin = tl.load(SIN + pos * R + i, mask=rotated, other=0.0).to(K.dtype.element_ty).to(ACC)
    out = k * cos + tl.where(i < half, -partner, partner) * sin  # rotate_half: (-x2, x1)
    dst = KV + b * s_b + h * s_h + tl.load(INDEX) * s_l + i
    tl.store(dst, out.to(KV.dtype.element_ty), mask=live)
    value = tl.load(V + b * svb + h * svh + i, mask=live, other=0.0)
    tl.store(dst + s_part, value.to(KV.dtype.element_ty), mask=live)


@functools.cache
def _jitted(interpret: bool):
    """The kernel compiled by Triton (or run by its interpreter), built at the first launch."""
    del interpret  # part of the cache key only: triton.jit reads the environment itself
    return triton.jit(_rotary_write_kernel)


def fast_path(kv: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> bool:
    """Whether :func:`write` runs its kernel for these tensors: one new position, a 2-d ``[B, 1]``
    positions tensor, no autograd, unit stride along the head, on a card that takes Triton's
    kernels or in its interpreter on CPU tensors."""
    here = (k.is_cuda and _flash_capable(k.device.index or 0)) or (k.device.type == "cpu" and interpreting())
    return (triton is not None and here and k.dtype in DTYPES and kv.dtype == k.dtype and k.dim() == 4
            and k.shape[2] == 1 and positions.dim() == 2 and positions.shape == (k.shape[0], 1)
            and k.stride(-1) == 1 and kv.is_contiguous()
            and not (torch.is_grad_enabled() and k.requires_grad))


def launch(kv: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, positions: torch.Tensor) -> None:
    """The kernel on the tensors' card (see the module docstring); ``v`` is made unit-stride if it
    is not."""
    v = v if v.stride(-1) == 1 else v.contiguous()
    _, b, h, _, d = kv.shape
    r = cos.shape[-1]
    acc = tl.float64 if k.dtype == torch.float64 else tl.float32
    kernel = _jitted(interpreting())
    with torch.cuda.device(k.device) if k.is_cuda else contextlib.nullcontext():
        kernel[(b * h,)](k, v, cos, sin, positions, index, kv, h, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         positions.stride(0), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
                         R=r, D=d, BLOCK_D=max(16, 1 << (d - 1).bit_length()), ACC=acc, num_warps=1)


@torch.library.custom_op("mhe::rotary_cache_write", mutates_args=("kv",))
def rotary_cache_write(kv: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, positions: torch.Tensor) -> None:
    """:func:`launch` as one operator that ``torch.compile`` keeps whole."""
    launch(kv, index, k, v, cos, sin, positions)


@rotary_cache_write.register_fake
def _(kv, index, k, v, cos, sin, positions):
    return None


def write(kv: torch.Tensor, index: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary,
          positions: torch.Tensor) -> None:
    """``kv[0, :, :, index] = rotary(k, positions)``, ``kv[1, :, :, index] = v`` in one kernel
    (:func:`fast_path` must hold)."""
    cos, sin = rotary.table(k.device)
    if torch.compiler.is_compiling():
        torch.ops.mhe.rotary_cache_write(kv, index, k, v, cos, sin, positions)
    else:
        launch(kv, index, k, v, cos, sin, positions)
