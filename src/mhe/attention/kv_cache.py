"""The caches attention decodes with: they store keys and values and nothing else.

What a query may see of a cache is the model's business (:mod:`mhe.attention.masks`, built
once per forward); a cache only holds tensors and where the next ones go.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.errors import MheError, require_positive


class KVCache(nn.Module):
    """Preallocated self-attention keys and values with static shapes, for incremental decoding.

    Holds ``n_kv_heads`` heads (:attr:`Attention.cache_heads
    <mhe.attention.base.Attention.cache_heads>`: n for MHA, n_kv for GQA, one for MQA, SHA and
    fast MHE). The buffers ``k, v: [B, h_kv, L, d]`` and the write position ``index`` (a 0-d
    long tensor) are non-persistent buffers advanced in place, so a decode step reads and writes
    only tensors and is the same graph for every token (CUDA graphs, ``torch.compile``), as
    gpt-fast's and torchtune's ``KVCache``.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        require_positive(batch=batch, n_kv_heads=n_kv_heads, max_len=max_len, head_dim=head_dim)
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, h_kv, L, d]
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, h_kv, L, d]
        self.register_buffer("index", torch.zeros((), dtype=torch.long, device=device), persistent=False)

    @property
    def max_len(self) -> int:
        """L, the positions the buffers hold (and :meth:`update` returns)."""
        return self.k.shape[2]

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.k.numel() * self.k.element_size() * 2

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v: [B, h_kv, T, d]`` at positions ``index .. index + T - 1``, advance
        ``index`` by T and return the whole buffers ``[B, h_kv, L, d]``."""
        b, h, _, d = self.k.shape
        t = k.shape[2]
        if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
            raise MheError(f"cache holds [B={b}, heads={h}, d={d}], got keys of shape {tuple(k.shape)}")
        if t > self.max_len or (not tracing() and int(self.index) + t > self.max_len):
            raise MheError(f"KV cache overflow: position {int(self.index)} + {t} new tokens > max_len {self.max_len}")
        at = self.index.view(1) if t == 1 else self.index + torch.arange(t, device=k.device)  # [T]
        self.k.index_copy_(2, at, k.to(self.k.dtype))
        self.v.index_copy_(2, at, v.to(self.v.dtype))
        self.index.add_(t)
        return self.k, self.v

    def reset(self) -> None:
        """Forget what was written: the next :meth:`update` writes at position 0."""
        self.index.zero_()


class CrossCache:
    """The encoder keys and values one cross-attention sublayer reads at every decode step.

    Empty (``k is None``) until stored; the sublayer stores them on its first call, or the
    caller stores them ahead (beam search, :meth:`EncoderDecoder.fill_cross_caches
    <mhe.models.seq2seq.EncoderDecoder.fill_cross_caches>`). Storing keys of the shape already
    held copies them in place, so a captured decode step keeps reading the same tensors.
    """

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, h_kv, S, d]
        self.v: torch.Tensor | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k is not None and self.k.shape == k.shape and self.k.dtype == k.dtype:
            self.k.copy_(k)
            self.v.copy_(v)
        else:
            self.k, self.v = k.contiguous(), v.contiguous()
        return self.k, self.v


def tracing() -> bool:
    """True inside torch.compile or a CUDA graph capture, where reading the device is not allowed."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
