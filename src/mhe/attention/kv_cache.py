"""The caches attention decodes with: they store keys and values and nothing else.

What a query may see of a cache is the model's business (:mod:`mhe.attention.masks`, built
once per forward); a cache only holds tensors and where the next ones go.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.compile_fallback import tracing
from mhe.errors import MheError, require_positive


ROTARY_STEP = True
"""Whether a decode step in a fused view (a session's) of MHA, GQA, MQA and of MHE's fast path
under rotary positions rotates its queries and keys and stacks its keys with its values in one
kernel (:func:`mhe.attention.rotary_step.rotate_step`), the cache then writing the stack as it is
(:meth:`KVCache.write_stacked`). The operator takes the sublayer's fused Q/K/V product whole
(``_step_product``) and makes the views itself, so that inductor hands it the product kernel's
output as it is: on an H200 at batch 1 (llama-135m, ``model.generate``, 256 + 256 tokens) every
kind launched 281 kernels a token with it against 341 (GQA) and 311 (MHA, MHE-Mul) without, at
0.718, 0.728 and 0.702 ms a token against 0.768, 0.746 and 0.721 (``decode.py tuning --rotations
separate,kernel``; docs/benchmarks.md, "The rotating step, given the product whole"). Its first
form, given the query, key and value views, lost: inductor copied each view into a buffer of its
own first (371 kernels a token, 7-12% slower)."""


class CachePosition(nn.Module):
    """Where the next keys go: one 0-d long tensor, shared by the caches of every layer of a
    model (:func:`layer_caches`), since every layer writes the same positions in a forward.
    Held as a module so that ``.to()`` on any cache moves the one tensor all of them read."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.register_buffer("index", torch.zeros((), dtype=torch.long, device=device), persistent=False)


class KVCache(nn.Module):
    """Preallocated self-attention keys and values with static shapes, for incremental decoding.

    Holds ``n_kv_heads`` heads (:attr:`Attention.cache_heads
    <mhe.attention.base.Attention.cache_heads>`: n for MHA, n_kv for GQA, one for MQA, SHA and
    fast MHE). Keys and values share one buffer ``kv: [2, B, h_kv, L, d]`` (``k = kv[0]``,
    ``v = kv[1]``, each contiguous), so a step writes both with one kernel; the write position
    ``index`` (a 0-d long tensor) is a :class:`CachePosition`, shared by a model's caches and
    advanced by the one made with ``advances=True`` (the last layer's), so a step advances it
    once. Both are non-persistent buffers changed in place: a decode step reads and writes only
    tensors and is the same graph for every token (CUDA graphs, ``torch.compile``), as gpt-fast's
    and torchtune's caches are. A cache made alone owns its position and advances it.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str | None = None,
                 position: CachePosition | None = None, advances: bool = True) -> None:
        super().__init__()
        require_positive(batch=batch, n_kv_heads=n_kv_heads, max_len=max_len, head_dim=head_dim)
        shape = (2, batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("kv", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.position = position if position is not None else CachePosition(device)
        self.advances = advances

    @property
    def k(self) -> torch.Tensor:
        """The keys, ``[B, h_kv, L, d]`` (a view of :attr:`kv`)."""
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:
        """The values, ``[B, h_kv, L, d]`` (a view of :attr:`kv`)."""
        return self.kv[1]

    @property
    def index(self) -> torch.Tensor:
        """The write position, a 0-d long tensor (shared with the model's other caches)."""
        return self.position.index

    @property
    def max_len(self) -> int:
        """L, the positions the buffers hold (and :meth:`update` returns)."""
        return self.kv.shape[3]

    def nbytes(self) -> int:
        """Bytes held by the key and value buffer."""
        return self.kv.numel() * self.kv.element_size()

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v: [B, h_kv, T, d]`` at positions ``index .. index + T - 1`` (advancing
        ``index`` by T if this cache :attr:`advances` it) and return the whole buffers
        ``[B, h_kv, L, d]``: one write of the two stacked (two writes, one a tensor, measured
        slower on an H200: inductor wrote each through a ``copy_``; docs/benchmarks.md, "The keys
        and values written apart is worse"). :meth:`write_stacked` checks the shapes."""
        if k.shape != v.shape:
            raise MheError(f"keys and values must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        return self.write_stacked(torch.stack((k, v)))

    def write_stacked(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``kv: [2, B, h_kv, T, d]`` (the keys, then the values, as :attr:`kv` holds them)
        at the write position in one write, advance as :meth:`update` does, and return the whole
        buffers."""
        if kv.dim() != 5 or kv.shape[0] != 2:
            raise MheError(f"a stacked write takes [2, B, heads, T, d] (keys, then values), got {tuple(kv.shape)}")
        self._check(kv.shape[1:])
        t = kv.shape[3]
        self.kv.index_copy_(3, self._positions(t, kv.device), kv.to(self.kv.dtype))
        return self._advance(t)

    def _check(self, shape) -> None:
        """New keys of ``shape`` ``[B, h_kv, T, d]`` fit this cache's rows, heads, width and room."""
        _, b, h, _, d = self.kv.shape
        if len(shape) != 4 or shape[0] != b or shape[1] != h or shape[3] != d:
            raise MheError(f"cache holds [B={b}, heads={h}, d={d}], got keys of shape {tuple(shape)}")
        t = shape[2]
        if t > self.max_len or (not tracing() and int(self.index) + t > self.max_len):
            raise MheError(f"KV cache overflow: position {int(self.index)} + {t} new tokens > max_len {self.max_len}")

    def _positions(self, t: int, device) -> torch.Tensor:
        """The ``T`` positions a write of ``t`` new tokens goes to (``[T]``, read on the device)."""
        return self.index.view(1) if t == 1 else self.index + torch.arange(t, device=device)

    def _advance(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Move the shared write position by ``t`` if this cache advances it; the whole buffers."""
        if self.advances:
            self.index.add_(t)
        return self.k, self.v

    def reset(self) -> None:
        """Forget what was written: the next :meth:`update` writes at position 0."""
        self.index.zero_()


def layer_caches(sublayers, batch: int, max_len: int, *, dtype=None, device=None) -> list[KVCache]:
    """One cache per self-attention sublayer of a model (in the order they run), sharing one
    write position that the last advances: a forward's layers write the same positions, and the
    position then moves once (one kernel a step, not one per layer)."""
    sublayers = list(sublayers)
    caches: list[KVCache] = []
    for i, attention in enumerate(sublayers):
        shared = {"position": caches[0].position} if caches else {}
        caches.append(attention.new_cache(batch, max_len, dtype=dtype, device=device,
                                          advances=i == len(sublayers) - 1, **shared))
    return caches


def check_layer_caches(caches) -> None:
    """Refuse caches a forward would write at different positions. Valid: one list from
    :func:`layer_caches` (``model.new_caches``), whole and in its order (one shared position,
    advanced by the last), or caches that each own and advance their position. A subset, a
    reordering or copies of single caches of a :func:`layer_caches` list are not (a layer after
    the advancing one would write one position late). Not checked while tracing."""
    caches = [c for c in caches if isinstance(c, KVCache)]
    if tracing() or not caches:
        return
    n = len(caches)
    shared = all(c.position is caches[0].position for c in caches)
    if shared and [c.advances for c in caches] == [False] * (n - 1) + [True]:
        return
    if all(c.advances for c in caches) and len({id(c.position) for c in caches}) == n:
        return
    raise MheError("these KV caches are not one model.new_caches(...) list, whole and in its order (its caches "
                   "share one write position that the last advances), nor caches that each keep their own")


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
