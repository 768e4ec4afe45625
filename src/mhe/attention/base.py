"""The attention contract every kind implements.

Shapes follow the paper's notation (section 3): ``d_model`` is m (written d_m in
the paper), ``n_heads`` is n and ``head_dim`` is d (d_h). Every kind maps
``x: [B, T, m] -> [B, T, m]`` through
``forward(x, *, context=None, mask=None, cache=None)``:

* ``context`` ``[B, S, m]`` turns the sublayer into cross-attention
  (keys and values come from the encoder output);
* ``mask`` is a boolean key-padding mask ``[B, S]``, True for real tokens, over
  every key the call attends to (with a cache: every position cached so far);
* ``cache`` is a :class:`KVCache` from :meth:`Attention.new_cache`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from mhe.attention import kernels
from mhe.errors import MheError, require_positive


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Options every attention kind shares.

    Attributes:
        d_model: model width m.
        n_heads: number of heads n.
        head_dim: per-head width d; defaults to m / n (then n must divide m).
        dropout: dropout on the attention probabilities (training only).
        causal: mask future positions in self-attention.
        bias: give every projection a bias (the paper's counts exclude biases).
        kernel: how the attention step is computed, a name in
            :data:`mhe.attention.kernels.KERNELS` (``sdpa``, ``eager``, ...); it never
            changes the function, only how it runs.
    """

    d_model: int
    n_heads: int
    head_dim: int | None = None
    dropout: float = 0.0
    causal: bool = False
    bias: bool = False
    kernel: str = "sdpa"

    def __post_init__(self) -> None:
        require_positive(d_model=self.d_model, n_heads=self.n_heads)
        kernels.check_kernel(self.kernel)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise MheError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass head_dim explicitly or choose n_heads dividing d_model"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        require_positive(head_dim=self.head_dim)
        for name in ("causal", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise MheError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise MheError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise MheError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def inner_dim(self) -> int:
        """n * d, the width of the concatenated heads."""
        return self.n_heads * self.head_dim

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


class KVCache(nn.Module):
    """Preallocated key/value buffers with static shapes, for incremental decoding.

    Holds ``n_kv_heads`` heads: n for MHA, n_kv for GQA, one for MQA, SHA and fast MHE.
    The buffers ``k, v: [B, h_kv, L, d]`` and the write position ``index`` (a 0-d tensor)
    are non-persistent buffers, so a decode step reads and writes only tensors: new keys
    and values are written at ``index .. index + T - 1`` with ``index_copy_`` and attention
    runs over the whole buffer under a mask (positions not yet written are never visible),
    so one decode step is the same graph for every token (CUDA graphs, ``torch.compile``).

    Cross-attention fills the first S positions once from the encoder output and reuses them.
    """

    def __init__(self, batch: int, n_kv_heads: int, max_len: int, head_dim: int,
                 *, dtype: torch.dtype, device: torch.device | str | None = None) -> None:
        super().__init__()
        require_positive(batch=batch, n_kv_heads=n_kv_heads, max_len=max_len, head_dim=head_dim)
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, h_kv, L, d]
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)  # [B, h_kv, L, d]
        self.register_buffer("index", torch.zeros((), dtype=torch.long, device=device), persistent=False)
        self.filled = 0  # cross-attention: how many encoder positions are stored
        self.fresh = True  # nothing written since the last reset: a prompt may attend to itself only

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

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

        Returns the whole buffers and the position of the first new token (a 0-d tensor).
        """
        t = k.shape[2]
        self._check(k)
        start = self.index.clone()
        if not _tracing():
            if int(start) + t > self.max_len:
                raise MheError(f"KV cache overflow: position {int(start)} + {t} new tokens > max_len {self.max_len}")
        at = start + torch.arange(t, device=k.device)  # [T]
        self.k.index_copy_(2, at, k.to(self.k.dtype))
        self.v.index_copy_(2, at, v.to(self.v.dtype))
        self.index.add_(t)
        if self.fresh:
            self.fresh = False
        return self.k, self.v, start

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
        """Select batch rows in place (beam search keeps the surviving hypotheses)."""
        self.k.copy_(self.k.index_select(0, index))
        self.v.copy_(self.v.index_select(0, index))

    def self_attention_mask(self, key_mask: torch.Tensor | None, t: int, start: torch.Tensor,
                            *, causal: bool) -> torch.Tensor:
        """What ``t`` new queries at ``start ..`` may see of the whole buffer, ``[B|1, 1, t, L]``.

        ``key_mask`` is ``[B, L]`` over the buffer, or ``[B, start + t]`` over the positions
        written so far (eager use).
        """
        return cache_mask(key_mask, t, start, self.max_len, causal=causal, device=self.k.device)

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


class Attention(nn.Module):
    """Base class: projections differ per kind, the attention step is shared.

    Subclasses implement ``_queries`` (``[B, T, m] -> [B, h_q, T, d]``),
    ``_keys_values`` (``[B, S, m] -> 2 x [B, h_kv, S, d]``) and ``_output``
    (``[B, h_q, T, d] -> [B, T, m]``), and set ``cache_heads``.
    """

    kind: ClassVar[str] = ""
    config_class: ClassVar[type[AttentionConfig]] = AttentionConfig
    supports_cache: ClassVar[bool] = True
    supports_cross: ClassVar[bool] = True

    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__()
        self.cfg = cfg

    # --- the contract ---------------------------------------------------
    @property
    def cache_heads(self) -> int:
        """How many key/value heads the KV cache holds for this kind."""
        raise NotImplementedError

    def new_cache(self, batch: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None) -> KVCache:
        """A preallocated cache sized for this kind (see :attr:`cache_heads`)."""
        if not self.supports_cache:
            raise MheError(f"attention kind {self.kind!r} mixes whole sequences and has no KV cache")
        p = next(self.parameters(), None)
        dtype = dtype or (p.dtype if p is not None else torch.float32)
        device = device if device is not None else (p.device if p is not None else None)
        return KVCache(batch, self.cache_heads, max_len, self.cfg.head_dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, *, context: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        self._check_input(x, context)
        q = self._queries(x)  # [B, h_q, T, d]
        cross = context is not None
        if cache is not None and not cross:
            if getattr(cache, "fresh", False) and mask is None and self.cfg.causal:
                # a prompt into an empty cache: plain causal SDPA over its own keys (flash), as without a cache
                k, v = self._keys_values(x)
                cache.update(k, v)
                return self._output(self._attend(q, k, v, key_mask=None, causal=True))
            k, v, start = cache.update(*self._keys_values(x))  # the whole buffers [B, h_kv, L, d]
            if mask is not None:
                self._check_mask(mask, x.shape[0], mask.shape[1])
            full = cache.self_attention_mask(mask, x.shape[1], start, causal=self.cfg.causal)
            return self._output(self._attend(q, k, v, mask=full))
        if cache is None:
            k, v = self._keys_values(context if cross else x)  # [B, h_kv, S, d]
        else:
            k, v = cache.cached() if cache.filled else cache.fill(*self._keys_values(context))
        key_mask = self._check_mask(mask, x.shape[0], k.shape[2])
        h = self._attend(q, k, v, key_mask=key_mask, causal=self.cfg.causal and not cross)
        return self._output(h)

    # --- hooks -------------------------------------------------------------
    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _keys_values(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _attend(self, q, k, v, **kw):
        """``kw``: ``key_mask`` and ``causal``, or a full boolean ``mask`` (static KV cache)."""
        return kernels.attend(q, k, v, dropout_p=self.cfg.dropout if self.training else 0.0,
                              kernel=self.cfg.kernel, **kw)

    # --- helpers -------------------------------------------------------------
    @staticmethod
    def _split_heads(t: torch.Tensor, n: int) -> torch.Tensor:
        b, s, _ = t.shape
        return t.view(b, s, n, -1).transpose(1, 2)  # [B, n, S, d]

    @staticmethod
    def _merge_heads(h: torch.Tensor) -> torch.Tensor:
        b, n, t, d = h.shape
        return h.transpose(1, 2).reshape(b, t, n * d)  # [B, T, n*d]

    def _check_input(self, x: torch.Tensor, context: torch.Tensor | None) -> None:
        m = self.cfg.d_model
        for name, t in (("input", x), ("context", context)):
            if name == "input" or t is not None:
                _check_floating(name, t, self)
        if x.dim() != 3 or x.shape[-1] != m:
            raise MheError(f"input must have shape [B, T, d_model={m}], got {tuple(x.shape)}")
        if context is not None and (context.dim() != 3 or context.shape[-1] != m
                                    or context.shape[0] != x.shape[0]):
            raise MheError(f"context must have shape [B={x.shape[0]}, S, d_model={m}], got {tuple(context.shape)}")

    @staticmethod
    def _check_mask(mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
        if mask is None:
            return None
        if mask.dtype != torch.bool or tuple(mask.shape) != (batch, keys):
            raise MheError(
                f"mask must be a boolean key-padding mask of shape [B={batch}, S={keys}], "
                f"got {mask.dtype} {tuple(mask.shape)}"
            )
        return mask

    def extra_repr(self) -> str:
        c = self.cfg
        return f"kind={self.kind}, d_model={c.d_model}, n_heads={c.n_heads}, head_dim={c.head_dim}, causal={c.causal}"


def _check_floating(name: str, t, module: nn.Module) -> None:
    """``t`` is a floating tensor of the weights' dtype (any float dtype under autocast)."""
    if not isinstance(t, torch.Tensor):
        raise MheError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise MheError(f"{name} must be a floating-point tensor [B, T, d_model], got {t.dtype}")
    w = next(module.parameters(), None)
    if w is not None and t.dtype != w.dtype and not torch.is_autocast_enabled(t.device.type):
        raise MheError(f"{name} is {t.dtype} but the weights are {w.dtype}; cast one to the other or use autocast")


def default_scale(head_dim: int) -> float:
    """1/sqrt(d_h), the scaled dot-product of the paper's Eq. 3."""
    return 1.0 / math.sqrt(head_dim)
