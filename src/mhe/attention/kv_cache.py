"""The static key/value cache every attention kind decodes with (:meth:`Attention.new_cache
<mhe.attention.base.Attention.new_cache>`), and the mask of what new queries may see of it."""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention import kernels
from mhe.errors import MheError, require_positive


class KVCache(nn.Module):
    """Preallocated key/value buffers with static shapes, for incremental decoding.

    Holds ``n_kv_heads`` heads: n for MHA, n_kv for GQA, one for MQA, SHA and fast MHE.
    The buffers ``k, v: [B, h_kv, L, d]`` and the write position ``index`` (a 0-d tensor)
    are non-persistent buffers, so a decode step reads and writes only tensors: new keys
    and values are written at ``index .. index + T - 1`` with ``index_copy_`` and attention
    runs over the whole buffer under a mask (positions not yet written are never visible),
    so one decode step is the same graph for every token (CUDA graphs, ``torch.compile``).

    Cross-attention fills the first S positions once from the encoder output and reuses them.
    ``window`` (a Python int, 0 = the whole buffer) limits self-attention and :meth:`reorder` to
    the first ``window`` positions: beam search captures one step per window, so early tokens
    do not pay for the whole ``max_len`` (the positions past the window are never visible).
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        require_positive(batch=batch, n_kv_heads=n_kv_heads, max_len=max_len, head_dim=head_dim)
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, h_kv, L, d]
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, h_kv, L, d]
        self.register_buffer("index", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        # where each batch row begins in the buffers viewed as [B*L, h_kv, d] (flash-decode's key offsets)
        self.register_buffer("row_offsets", torch.arange(batch + 1, dtype=torch.int32, device=device) * max_len,
                             persistent=False)
        self.register_buffer("no_padding", torch.zeros(batch, dtype=torch.int32, device=device), persistent=False)
        self.filled = 0  # cross-attention: how many encoder positions are stored
        self.fresh = True  # nothing written since the last reset: a prompt may attend to itself only
        self.window = 0  # positions a decode step attends over and reorders (0: all)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def span(self) -> int:
        """Positions a decode step sees: ``window`` if set, else the whole buffer."""
        return self.window or self.max_len

    @property
    def pos(self) -> int:
        """Positions written so far (reads the device: not for a compiled step)."""
        return int(self.index)

    @pos.setter
    def pos(self, value: int) -> None:
        self.index.fill_(value)
        self.fresh = value == 0

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return self.k.numel() * self.k.element_size() * 2

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write ``k, v: [B, h_kv, T, d]`` at ``index`` and advance it in place.

        Returns the buffers (their first :attr:`span` positions) and the position of the first
        new token (a 0-d tensor).
        """
        t = k.shape[2]
        self._check(k)
        start = self.index.clone()
        if not _tracing():
            if int(start) + t > self.max_len:
                raise MheError(f"KV cache overflow: position {int(start)} + {t} new tokens > max_len {self.max_len}")
            if int(start) + t > self.span:
                raise MheError(f"KV cache window {self.window} too small for position {int(start)} + {t} new tokens")
        at = start + torch.arange(t, device=k.device)  # [T]
        self.k.index_copy_(2, at, k.to(self.k.dtype))
        self.v.index_copy_(2, at, v.to(self.v.dtype))
        self.index.add_(t)
        if self.fresh:
            self.fresh = False
        n = self.span
        return self.k[:, :, :n], self.v[:, :, :n], start

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` and return every cached position (eager use; reads the device)."""
        self.update(k, v)
        return self.cached()

    def fill(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store cross-attention keys and values ``[B, h_kv, S, d]`` once."""
        s = k.shape[2]
        self._check(k)
        if s > self.max_len:
            raise MheError(f"KV cache overflow: {s} encoder positions > max_len {self.max_len}")
        self.k[:, :, :s].copy_(k)
        self.v[:, :, :s].copy_(v)
        self.filled = s
        return self.cached()

    def cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.filled or self.pos
        return self.k[:, :, :n], self.v[:, :, :n]

    def reset(self) -> None:
        self.index.zero_()
        self.filled = 0
        self.fresh = True

    def reorder(self, index: torch.Tensor) -> None:
        """Select batch rows in place (beam search keeps the surviving hypotheses), over the
        first :attr:`span` positions."""
        n = self.span
        for buf in (self.k, self.v):
            part = buf[:, :, :n]  # [B, h_kv, span, d]
            part.copy_(part.index_select(0, index))

    def self_attention_mask(self, key_mask: torch.Tensor | None, t: int, start: torch.Tensor,
                            *, causal: bool) -> torch.Tensor:
        """What ``t`` new queries at ``start ..`` may see of the buffer's first :attr:`span`
        positions, ``[B|1, 1, t, span]``.

        ``key_mask`` is ``[B, L]`` over the buffer, or ``[B, start + t]`` over the positions
        written so far (eager use).
        """
        return cache_mask(key_mask, t, start, self.span, causal=causal, device=self.k.device)

    def decode_range(self, key_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys the one causal query just written by :meth:`update` sees, as flash-decode
        reads them: the run ``[first_b, index)`` of each row, returned as ``(cum_seq_k [B + 1],
        used [B])`` (int32; see :mod:`mhe.attention.flash_decode`).

        Equals :meth:`self_attention_mask` for that query when ``key_mask`` (``[B, W]``) is left
        padding (False then True in every row), which is what generation passes. One kernel
        without a key mask, five with one: building the mask instead costs more kernels than
        the split-K attention saves.
        """
        if key_mask is None:
            return self.row_offsets, self.index + self.no_padding  # [B] int32: every written position
        first = key_mask.shape[1] - key_mask.sum(-1, dtype=torch.int32)  # [B]: each row's left padding
        return self.row_offsets + torch.nn.functional.pad(first, (0, 1)), self.index - first

    def _check(self, k: torch.Tensor) -> None:
        b, h, _, d = self.k.shape
        if k.shape[0] != b or k.shape[1] != h or k.shape[3] != d:
            raise MheError(f"cache holds [B={b}, heads={h}, d={d}], got keys of shape {tuple(k.shape)}")
        if k.shape[2] > self.max_len:
            raise MheError(f"KV cache overflow: {k.shape[2]} new tokens > max_len {self.max_len}")


def cache_mask(key_mask: torch.Tensor | None, t: int, start: torch.Tensor | int, length: int, *, causal: bool,
               device: torch.device) -> torch.Tensor:
    """What ``t`` new queries at ``start ..`` may see of a cache of ``length`` positions,
    ``[B|1, 1, t, length]``: keys written so far (up to the query itself when ``causal``) that
    ``key_mask`` (``[B, length]``, or ``[B, start + t]`` over the positions so far) allows."""
    if key_mask is not None and key_mask.shape[1] != length:
        if _tracing() or key_mask.shape[1] != int(start) + t:
            raise MheError(f"mask must be a boolean key-padding mask of shape [B={key_mask.shape[0]}, "
                           f"S={length}] (the cache) or [B, {int(start) + t}] (positions so far), "
                           f"got {tuple(key_mask.shape)}")
        key_mask = torch.nn.functional.pad(key_mask, (0, length - key_mask.shape[1]), value=False)
    if causal:
        return kernels.build_mask(key_mask, causal=True, q_len=t, k_len=length, offset=start, device=device)
    written = torch.arange(length, device=device) < start + t  # [L]
    mask = written[None, None, None, :]
    return mask if key_mask is None else mask & key_mask[:, None, None, :]


def _tracing() -> bool:
    """True inside torch.compile or a CUDA graph capture, where reading the device is not allowed."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
