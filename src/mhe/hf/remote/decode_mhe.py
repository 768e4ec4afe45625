"""One new token over one cached K/V head under a mask, split across the keys (no mhe needed).

A decode step of MHE (one shared K/V head) stacks its n query heads as the rows of one query,
``[B, 1, n, d]`` over ``k, v: [B, 1, L, d]`` (``layers_mhe.attend``). Under a mask (a static
cache's unwritten positions, padding) SDPA runs that on its memory-efficient kernel, whose thread
blocks split the query rows but not the keys: one block per batch row, so at batch 64 most of a
large card idles and each block reads its row's whole cache alone, and at batch 1 one block does
all the work. FlashAttention-2's variable-length forward (``aten._flash_attention_forward`` with
``seqused_k``) reads exactly the keys a row may see and splits them across thread blocks
("flash-decoding", Dao et al. 2023), merging the parts by their log-sum-exp.

It needs what each row sees to be one run of cache positions ``[first_b, first_b + used_b)``:
left padding, then the keys up to the new token, then a static cache's unwritten positions. That
is checked on the host where the step runs eagerly (:func:`left_padded`; generate's prompt) and
kept on the cache for the compiled steps that follow; a mask with holes takes SDPA.
"""

from __future__ import annotations

import math

import torch

_OP = getattr(torch.ops.aten, "_flash_attention_forward", None)
CAPABLE = _OP is not None and any(a.name == "seqused_k" for a in _OP.default._schema.arguments)
"""This torch's FlashAttention-2 forward takes ``seqused_k`` (read once, here: not inside a compiled step)."""

SPLIT_DECODE = True
"""Whether decode steps take the split kernel (the policy; switch it off to compare with SDPA's
masked path). On an H200 in bf16 its greedy tokens and logits are those of SDPA's masked path and,
within bf16 rounding, of the float32 model (``test_exported_bf16_split_decode_on_gpu``)."""

VARLEN = SPLIT_DECODE and CAPABLE
"""The split kernel is used where it fits (the policy and the capability)."""

FLAG = "_mhe_key_runs"
"""The cache attribute that says each row's keys are one run (set by :func:`mark_cache`)."""


def flash_capable(device, dtype) -> bool:
    """FlashAttention-2 on this device and dtype: CUDA compute capability 8.0 or newer, fp16/bf16."""
    return (VARLEN and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(device)[0] >= 8)


def left_padded(attention_mask, last: int) -> bool:
    """Whether every row of ``attention_mask`` lets the query at position ``last`` see one run of
    keys that ends at ``last``, and a later key appended to the row extends that run: a 2D mask
    (1 = real token) whose rows are 0s then 1s, or a 4D mask (True or 0 = attend) whose last
    query row is False, then True up to ``last``, then False. One read of the device."""
    if attention_mask is None:
        return True
    if attention_mask.dim() == 2:
        rows = attention_mask.to(torch.bool)
        return bool((rows[:, 1:] >= rows[:, :-1]).all())
    m = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    rows = m[:, 0, -1, :]  # [B, L]
    first, used = rows.to(torch.uint8).argmax(-1), rows.sum(-1)
    ok = (first + used == last + 1) & ~rows[:, last + 1:].any(-1) & (used > 0)
    return bool(ok.all())


def mark_cache(cache, attention_mask, start, t: int, device, dtype) -> None:
    """Record on ``cache`` whether its decode steps may read each row's keys as one run, for the
    T = ``t`` tokens at positions ``start ..`` of an eager call (generate's prompt; a compiled step
    only reads the mark). Reads the device only on a card the split kernel runs on."""
    ok = flash_capable(device, dtype)
    if ok and attention_mask is not None:
        last = int(start) + t - 1 if attention_mask.dim() == 4 else 0
        ok = left_padded(attention_mask, last)
    setattr(cache, FLAG, ok)


def marked(cache) -> bool:
    return bool(getattr(cache, FLAG, False)) if cache is not None else False


def fits(q, k, v, mask, causal: bool, dropout_p: float) -> bool:
    """A call the split kernel takes: one query token, one K/V head, fp16/bf16, a contiguous cache,
    a mask without a query axis, a head size FlashAttention takes; the rest goes to SDPA."""
    return (VARLEN and on_card(q, k, v) and q.shape[2] == 1 and k.shape[1] == 1 and v.shape[1] == 1
            and not causal and dropout_p == 0.0 and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256
            and v.shape[-1] == q.shape[-1] and k.is_contiguous() and v.is_contiguous()
            and mask is not None and mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1)


def on_card(q, k, v) -> bool:
    """q, k and v on CUDA in one dtype, fp16 or bf16."""
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype and v.dtype == q.dtype


def key_range(mask, batch: int, keys: int):
    """``(cum_seq_q [B + 1], cum_seq_k [B + 1], used [B])`` int32 of a boolean mask ``[B|1, 1, 1, L]``
    that allows one run per row: row b's run starts at its first True, ``b*L + first_b`` in the
    ``(B*L, 1, d)`` view of the cache, and holds its count of Trues. Once a forward, for every layer."""
    rows = mask.reshape(mask.shape[0], keys).expand(batch, keys)
    first = rows.to(torch.uint8).argmax(-1).to(torch.int32)  # the first True (the first maximum)
    used = rows.sum(-1, dtype=torch.int32)
    cum_q = torch.arange(batch + 1, dtype=torch.int32, device=mask.device)
    cum_k = torch.cat([cum_q[:batch] * keys + first, cum_q[batch:] * keys])
    return cum_q, cum_k, used


def flash_decode(q, k, v, ranges, scale=None):
    """``q [B, 1, R, d]`` (R query rows: the heads of one new token) over ``k, v [B, 1, L, d]``, row b
    reading the keys ``ranges`` gives it (:func:`key_range`): ``[B, 1, R, d]``. The cache is read
    in place as ``(B*L, 1, d)``; the rows go in as R heads of one query a row, which FlashAttention
    moves into its query-length dimension (one K/V head) before splitting the keys."""
    b, _, r, d = q.shape
    keys = k.shape[2]
    cum_q, cum_k, used = ranges
    out = _OP(q.reshape(b, r, d), k.view(b * keys, 1, d), v.view(b * keys, 1, d), cum_q, cum_k, 1, keys, 0.0,
              False, False, scale=1.0 / math.sqrt(d) if scale is None else scale, seqused_k=used)[0]
    return out.view(b, 1, r, d)
