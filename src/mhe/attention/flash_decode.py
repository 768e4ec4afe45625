"""The ``flash-decode`` kernel: one new token over a one-K/V-head cache, split across the keys.

A decode step of MQA (and of MHE folded to MQA) reads a cache ``k, v: [B, 1, S, d]`` with
``h_q`` query heads. SDPA's memory-efficient kernel (the one a boolean mask selects) gives
this problem ``B x ceil(h_q / 64)`` thread blocks, one per batch row, so at batch 64 an
H100's 132 SMs are half idle and the cache is read at a fraction of the card's bandwidth
(docs/benchmarks.md section 5). FlashAttention-2's variable-length forward, reached through
``torch.ops.aten._flash_attention_forward``, handles exactly this case ("flash-decoding",
Dao et al. 2023): with one query per row and more query heads than K/V heads it moves the
query heads into the query-length dimension and splits the keys of each row across thread
blocks, merging the partial softmaxes by their log-sum-exp.

The cache is passed as ``(B*S, 1, d)`` views (no copy). Each batch row may see one
contiguous run of cache positions, ``[start_b, start_b + used_b)``: left padding at the
front, positions not yet written at the back, given to FlashAttention as
``cum_seq_k[b] = b*S + start_b`` and ``seqused_k[b] = used_b``. The kernel registers
``reads_key_range``, so a decode step's model builds that run once per forward and hands it
to every layer (``key_range``, from :func:`mhe.attention.masks.decode_key_range`: a few
elementwise kernels, where building the mask and reading the run back from it costs more
than the attention saves); called with a boolean mask instead, the kernel reads the run from
the mask (:func:`mask_range`). Every shape is static and nothing reads the device, so the
step stays capturable as a CUDA graph.

Precondition: the mask allows ONE contiguous run of keys per batch row. Every mask the
static cache builds from a left-padded key mask is such a run (causal decoding, left
padding, a partially filled buffer); a mask with holes would be read as a run as long as its
count of allowed keys from its first one, which is wrong, so generation only chooses this
kernel for left-padded prompts (:func:`mhe.generation.session.generate`). Every case outside the
fast path (CPU, fp32, dropout, several query tokens, several K/V heads, a head size not a
multiple of 8, a torch without ``seqused_k``) runs the ``sdpa`` kernel unchanged.
"""

from __future__ import annotations

import functools
import math

import torch

from mhe.attention.kernels import register_kernel, sdpa_kernel

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@functools.cache
def _schema_has_seqused_k() -> bool:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return False
    return any(a.name == "seqused_k" for a in op.default._schema.arguments)


def constant_result(fn):
    """``torch.compiler.assume_constant_result`` without importing dynamo when this module is
    imported (about 3 s of the ``mhe`` command's start-up on 2 cores): it sets the mark dynamo's
    own decorator sets (torch 2.5-2.13; ``tests/cli/test_cli_imports.py`` checks that they agree)."""
    fn._dynamo_marked_constant = True
    return fn


# The two checks below run inside a compiled decode step: dynamo cannot trace the schema walk
# (a graph break per step), so it calls them while tracing and keeps their answers as constants.
@constant_result
def varlen_has_seqused_k() -> bool:
    """True when this torch's ``aten._flash_attention_forward`` takes ``seqused_k``."""
    return _schema_has_seqused_k()


@functools.cache
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@constant_result
def _flash_capable(index: int) -> bool:
    """FlashAttention-2 needs an Ampere-or-newer card (compute capability 8.0+)."""
    return _capability_major(index) >= 8


def mask_range(mask: torch.Tensor | None, batch: int, length: int, *, device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The run of keys each batch row may see, as ``start, used: [B]`` (int32).

    Args:
        mask: boolean ``[B|1, 1, 1, S]`` (True = attend), one contiguous run of True per row,
            or None (every key).
        batch: B; length: S.

    ``start`` is the index of the first True, ``used`` the number of Trues; a row with no
    True gets ``start = 0, used = 0`` (FlashAttention then returns zeros for it).
    """
    if mask is None:
        start = torch.zeros(batch, dtype=torch.int32, device=device)
        return start, torch.full((batch,), length, dtype=torch.int32, device=device)
    rows = mask.reshape(mask.shape[0], mask.shape[-1]).expand(batch, length)  # [B, S]
    start = rows.to(torch.uint8).argmax(-1)  # the first True (the first maximum)
    used = rows.sum(-1)
    return start.to(torch.int32), used.to(torch.int32)


def key_offsets(start: torch.Tensor, length: int) -> torch.Tensor:
    """``cum_seq_k: [B + 1]`` (int32): where row b's keys begin in the ``(B*S, 1, d)`` view
    (``b*S + start_b``), then ``B*S``."""
    b = start.shape[0]
    base = torch.arange(b, device=start.device, dtype=torch.int32) * length + start  # [B]
    return torch.cat([base, torch.full((1,), b * length, dtype=torch.int32, device=start.device)])


def range_mask(key_range: tuple[torch.Tensor, ...], length: int) -> torch.Tensor:
    """The boolean mask ``[B, 1, 1, S]`` of a run ``(cum_seq_k, used)`` (for the fallback)."""
    offsets, used = key_range[:2]
    b = used.shape[0]
    start = offsets[:b] - torch.arange(b, device=used.device, dtype=torch.int32) * length  # [B]
    pos = torch.arange(length, device=used.device)[None, :]  # [1, S]
    return ((pos >= start[:, None]) & (pos < (start + used)[:, None]))[:, None, None, :]


def fast_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              dropout_p: float) -> bool:
    """Whether ``flash-decode`` runs FlashAttention (else it runs ``sdpa``)."""
    return (q.is_cuda and q.dtype in FLASH_DTYPES and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[2] == 1 and k.shape[1] == 1 and not is_causal and dropout_p == 0.0
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and k.is_contiguous() and v.is_contiguous()
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and mask.shape[1] == 1 and mask.shape[2] == 1))
            and varlen_has_seqused_k() and _flash_capable(q.device.index or 0))


def query_offsets(batch: int, device: torch.device) -> torch.Tensor:
    """``cum_seq_q: [B + 1]`` (int32): one query per batch row."""
    return torch.arange(batch + 1, device=device, dtype=torch.int32)


@register_kernel("flash-decode", reads_key_range=True)
def flash_decode_kernel(q, k, v, *, mask, is_causal, dropout_p, scale, key_range=None):
    """``key_range``: ``(cum_seq_k [B + 1], used [B])`` int32, in place of ``mask``, optionally
    followed by ``cum_seq_q [B + 1]`` (built once per forward by the model, so that a layer
    launches no kernel of its own for it)."""
    s = k.shape[2]
    if not fast_path(q, k, v, mask, is_causal, dropout_p):
        if key_range is not None:
            mask = range_mask(key_range, s)
        return sdpa_kernel(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    b, hq, _, d = q.shape
    if key_range is None:
        start, used = mask_range(mask, b, s, device=q.device)
        key_range = key_offsets(start, s), used
    rows = q.reshape(b, hq, d)  # [total_q = B, h_q, d]: one query per batch row
    cum_q = key_range[2] if len(key_range) > 2 else query_offsets(b, q.device)  # [B + 1]
    out = torch.ops.aten._flash_attention_forward(
        rows, k.view(b * s, 1, d), v.view(b * s, 1, d),  # [B*S, 1, d]: the cache, no copy
        cum_q, key_range[0], 1, s, 0.0, False, False,
        scale=1.0 / math.sqrt(d) if scale is None else scale, seqused_k=key_range[1])[0]
    return out.reshape(b, hq, 1, d)  # [B, h_q, 1, d]
