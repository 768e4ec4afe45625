"""The attention step itself: softmax(q k^T / sqrt(d)) v (paper Eq. 3).

This is the only module that knows how attention is computed. ``sdpa`` calls
``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient /
math kernels, grouped-query heads through ``enable_gqa``); ``eager`` writes the
softmax out and is kept for tests and for reading attention maps.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mhe.errors import one_of

BACKENDS = ("sdpa", "eager")
GQA_MODES = ("native", "expand")
_GQA_MODE = "native"
DECODE_KERNELS = ("sdpa", "matmul")
_DECODE_KERNEL = "sdpa"


def set_decode_kernel(kind: str) -> None:
    """How one new token attends over a grouped (one or few head) cache: ``sdpa`` (default) or
    an explicit ``matmul`` -> softmax -> ``matmul``. On an H200 the matmul form measured 4x
    slower at batch 64 x 4096 keys (docs/benchmarks.md, section 3); it is kept as a reference."""
    global _DECODE_KERNEL
    if kind not in DECODE_KERNELS:
        raise one_of("decode kernel", kind, DECODE_KERNELS)
    _DECODE_KERNEL = kind


def set_gqa_mode(mode: str) -> None:
    """How grouped heads reach SDPA in training: ``native`` (``enable_gqa``) or ``expand``
    (key/value heads repeated to the query heads). Decoding one token always folds the
    query heads into query rows instead (see :func:`attend`)."""
    global _GQA_MODE
    if mode not in GQA_MODES:
        raise one_of("GQA mode", mode, GQA_MODES)
    _GQA_MODE = mode


def build_mask(key_mask: torch.Tensor | None, *, causal: bool, q_len: int, k_len: int,
               offset: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask broadcastable to ``[B, h, T, S]``; True where attention is allowed.

    Query ``i`` sits at absolute position ``offset + i``; with ``causal`` it may
    see keys ``0 .. offset + i``.
    """
    mask = None
    if causal:
        qpos = torch.arange(q_len, device=device)[:, None] + offset
        kpos = torch.arange(k_len, device=device)[None, :]
        mask = (kpos <= qpos)[None, None]  # [1, 1, T, S]
    if key_mask is not None:
        km = key_mask[:, None, None, :]  # [B, 1, 1, S]
        mask = km if mask is None else mask & km
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: torch.Tensor | None = None,
           causal: bool = False, offset: int = 0, dropout_p: float = 0.0,
           scale: float | None = None, backend: str = "sdpa") -> torch.Tensor:
    """Attend ``q: [B, h_q, T, d]`` over ``k, v: [B, h_kv, S, d]``; h_kv divides h_q.

    Query heads are grouped onto key/value heads as in grouped-query attention:
    head ``i`` reads key/value head ``i // (h_q / h_kv)``.
    """
    if backend not in BACKENDS:
        raise one_of("attention backend", backend, BACKENDS)
    t, s = q.shape[2], k.shape[2]
    gqa = k.shape[1] != q.shape[1]
    if backend == "eager":
        return _eager(q, k, v, key_mask=key_mask, causal=causal, offset=offset,
                      dropout_p=dropout_p, scale=scale)
    if gqa and t == 1 and dropout_p == 0.0 and (not causal or offset == s - 1):
        # One new token sees every cached key, so the h_q/h_kv query heads of a group can be
        # stacked as query rows of one head: a dense [group, S] attention per key/value head.
        b, hq, _, d = q.shape
        hk = k.shape[1]
        rows = q.reshape(b, hk, hq // hk, d)  # [B, h_kv, group, d]
        mask = None if key_mask is None else key_mask[:, None, None, :]
        if _DECODE_KERNEL == "matmul":
            sc = rows @ k.transpose(-2, -1)  # [B, h_kv, group, S]
            sc = sc.to(torch.promote_types(sc.dtype, torch.float32)) * (scale or 1.0 / math.sqrt(d))
            if mask is not None:
                sc = sc.masked_fill(~mask, float("-inf"))
            out = sc.softmax(-1).to(v.dtype) @ v  # [B, h_kv, group, d]
        else:
            out = F.scaled_dot_product_attention(rows, k, v, attn_mask=mask, scale=scale)
        return out.reshape(b, hq, 1, d)  # [B, h_q, 1, d]
    if gqa and _GQA_MODE == "expand":
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
        gqa = False
    if causal and key_mask is None and offset == 0 and t == s:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p,
                                              scale=scale, enable_gqa=gqa)
    causal_needed = causal and not (t == 1 and offset == s - 1)  # one new token sees every key
    mask = build_mask(key_mask, causal=causal_needed, q_len=t, k_len=s, offset=offset, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                          scale=scale, enable_gqa=gqa)


def attention_weights(q: torch.Tensor, k: torch.Tensor, *, key_mask: torch.Tensor | None = None,
                      causal: bool = False, offset: int = 0, scale: float | None = None) -> torch.Tensor:
    """Softmax attention probabilities ``[B, h_q, T, S]`` (for inspection)."""
    k = _repeat_kv(k, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, h, T, S]
    mask = build_mask(key_mask, causal=causal, q_len=q.shape[2], k_len=k.shape[2], offset=offset,
                      device=q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def _eager(q, k, v, *, key_mask, causal, offset, dropout_p, scale):
    probs = attention_weights(q, k, key_mask=key_mask, causal=causal, offset=offset, scale=scale)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ _repeat_kv(v, q.shape[1])  # [B, h_q, T, d]


def _repeat_kv(t: torch.Tensor, n_q: int) -> torch.Tensor:
    h = t.shape[1]
    return t if h == n_q else t.repeat_interleave(n_q // h, dim=1)
