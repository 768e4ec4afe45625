"""The attention contract every kind implements.

Shapes follow the paper's notation (section 3): ``d_model`` is m (written d_m in
the paper), ``n_heads`` is n and ``head_dim`` is d (d_h). Every kind maps
``x: [B, T, m] -> [B, T, m]`` through
``forward(x, *, positions=None, context=None, mask=None, cache=None)``:

* ``positions`` ``[B, T]`` or ``[T]`` (long): the absolute positions of x's tokens, computed
  once per forward by the model and handed to the kind's projections (``_queries``,
  ``_keys_values``), where a position-dependent embedding (rotary) would act;
* ``context`` ``[B, S, m]`` turns the sublayer into cross-attention
  (keys and values come from the encoder output);
* ``mask`` is the :class:`~mhe.attention.masks.AttentionMask` the model built once for every
  layer, or (a sublayer called on its own) a boolean key-padding mask ``[B, S]``, True for
  real tokens, over every key the call attends to (with a cache: the cache, or every
  position so far);
* ``cache`` is a :class:`~mhe.attention.kv_cache.KVCache` from :meth:`Attention.new_cache`
  (self-attention) or a :class:`~mhe.attention.kv_cache.CrossCache` (cross-attention);
* ``plan`` is a decoding run's :class:`~mhe.attention.kernels.DecodePlan` (the kernel every layer
  runs and the mask form it reads), handed down by the model; None: the sublayer's configured
  kernel (``cfg.kernel``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import torch
from torch import nn

from mhe.attention import kernels, masks
from mhe.attention.kernels import DecodePlan
from mhe.attention import kv_cache
from mhe.attention.kv_cache import CachePosition, CrossCache, KVCache
from mhe.attention.options import AttentionConfig, NoOptions  # noqa: F401 (re-exported)
from mhe.attention.masks import AttentionMask
from mhe.attention.rotary import RotaryEmbedding
from mhe.attention.spec import AttentionSpec, specs_of
from mhe.errors import MheError, one_of


class Attention(nn.Module):
    """Base class: projections differ per kind, the attention step is shared.

    Subclasses implement ``_queries(x, positions)`` (``[B, T, m] -> [B, h_q, T, d]``),
    ``_keys_values(src, positions)`` (``[B, S, m] -> 2 x [B, h_kv, S, d]``) and ``_output``
    (``[B, h_q, T, d] -> [B, T, m]``); the kinds a class builds are the specs that name it
    (:data:`mhe.attention.spec.SPECS`), and an instance knows its ``kind`` and ``spec`` (the
    registry passes the kind; the class's first is the default). The projection
    hooks receive the tokens' absolute positions, so a position-dependent embedding (rotary)
    acts there, before keys are cached: with a rotary embedding attached (:meth:`attach_rotary`)
    each kind rotates where it needs to (:meth:`_rotate`; MHE before or after its head
    embeddings), values never. ``forward`` has one self-attention path: the new keys
    and values go through the cache when there is one, and the kernel reads what the mask covers.
    """

    supports_cache: ClassVar[bool] = True
    supports_cross: ClassVar[bool] = True

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        super().__init__()
        own = {s.name: s for s in specs_of(type(self))}
        self.kind = kind or next(iter(own))
        if self.kind not in own:
            raise one_of(f"kind for {type(self).__name__}", self.kind, own)
        self.spec: AttentionSpec = own[self.kind]
        want = self.spec.options
        if type(cfg.options) is not want:
            raise MheError(f"attention kind {self.kind!r} takes {want.__name__}, got {type(cfg.options).__name__}")
        self.cfg = cfg
        self.rotary: RotaryEmbedding | None = None

    # --- the contract ---------------------------------------------------
    @property
    def cache_heads(self) -> int:
        """How many key/value heads the KV cache holds for this kind (its spec's rule, under this
        sublayer's rotary positions)."""
        return self.spec.cache_heads(self.cfg.n_heads, self.cfg.options, rotary=self.rotary is not None)

    def new_cache(self, batch: int, max_len: int, *, dtype: torch.dtype | None = None,
                  device: torch.device | str | None = None, position: CachePosition | None = None,
                  advances: bool = True) -> KVCache:
        """A preallocated cache sized for this kind (:attr:`cache_heads`); ``position``, ``advances``:
        a write position shared by a model's caches (:func:`~mhe.attention.kv_cache.layer_caches`)."""
        if not self.supports_cache:
            raise MheError(f"attention kind {self.kind!r} mixes whole sequences and has no KV cache")
        p = next(self.parameters(), None)
        dtype = dtype or (p.dtype if p is not None else torch.float32)
        device = device if device is not None else (p.device if p is not None else None)
        return KVCache(batch, self.cache_heads, max_len, self.cfg.head_dim, dtype=dtype, device=device,
                       position=position, advances=advances)

    def forward(self, x: torch.Tensor, *, positions: torch.Tensor | None = None,
                context: torch.Tensor | None = None, mask: AttentionMask | torch.Tensor | None = None,
                cache: KVCache | CrossCache | None = None, plan: DecodePlan | None = None) -> torch.Tensor:
        self._check_input(x, context)
        if positions is None:
            positions = self._positions(x, cache if context is None else None)
        if not isinstance(mask, AttentionMask):  # called on its own: the mask a model would build
            mask = masks.sublayer_mask(x, mask, context=context, cache=cache, causal=self.cfg.causal,
                                       plan=plan or DecodePlan.of(self.cfg.kernel))
        if context is None:
            if (rotated := self._rotated_step(x, positions, cache)) is not None:
                q, stacked = rotated  # queries and keys rotated, keys and values stacked, in one kernel
                k, v = cache.write_stacked(stacked)
            else:
                q, k, v = self._self_projections(x, positions)  # [B, h_q, T, d] or FactoredQuery; [B, h_kv, T, d]
                if cache is not None:
                    k, v = cache.update(k, v)  # [B, h_kv, L, d]: every position the cache holds
        else:
            q = self._queries(x, positions)  # [B, h_q, T, d]
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v  # the encoder's keys, stored at the first step
            else:
                k, v = self.cross_keys_values(context)  # [B, h_kv, S, d]
                if cache is not None:
                    k, v = cache.store(k, v)
        if mask.keys is not None:
            k, v = k[:, :, :mask.keys], v[:, :, :mask.keys]  # the positions the mask covers
        return self._output(self._attend(q, k, v, mask, self.cfg.kernel if plan is None else plan.kernel))

    def cross_keys_values(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values cross-attention reads from ``context`` ``[B, S, m]``,
        ``2 x [B, h_kv, S, d]`` (what a :class:`CrossCache` stores)."""
        return self._keys_values(context, None)

    def _self_projections(self, x: torch.Tensor, positions: torch.Tensor | None):
        """Self-attention's queries ``[B, h_q, T, d]``, keys and values ``2 x [B, h_kv, T, d]``
        (one matrix product for all three once :func:`~mhe.attention.fused_projections.fuse_projections`
        gave the sublayer a ``fused_proj``)."""
        return (self._queries(x, positions), *self._keys_values(x, positions))

    def _step_product(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int] | None:
        """A decode step's fused Q/K/V product ``[B, 1, (h + 2 g) d]`` with its ``h`` query (or
        shared-query) and ``g`` K/V heads, whose split (``rotary_step.split_product``) gives this
        sublayer's queries and keys as they are just before their rotation, the last thing done to
        them, so that one kernel may rotate both (:meth:`_rotated_step`); None where the sublayer's
        projections are not one product or something follows the rotation. None by default; the
        fused views of MHA, GQA, MQA and of MHE's fast path give theirs."""
        return None

    def _step_query(self, q: torch.Tensor):
        """The rotated queries of :meth:`_step_product` as the attention kernel takes them (MHE: a
        :class:`~mhe.attention.kernels.FactoredQuery` of its shared query)."""
        return q

    def _rotated_step(self, x: torch.Tensor, positions: torch.Tensor | None, cache):
        """With :data:`~mhe.attention.kv_cache.ROTARY_STEP`, a one-token step under rotary positions
        with a cache: the fused Q/K/V product made, then its queries and keys rotated and its keys
        stacked with its values by one kernel (``rotary_step.rotate_step``; where it does not run,
        by the embedding and ``torch.stack``, with the same numbers): the queries and the stack the
        cache writes. None where this sublayer does not step so."""
        if not (kv_cache.ROTARY_STEP and self.rotary is not None and isinstance(cache, KVCache)
                and positions is not None and x.shape[1] == 1):
            return None
        product = self._step_product(x)
        if product is None:
            return None
        from mhe.attention import rotary_step  # Triton's kernel: loaded only where a step uses it

        qkv, heads, kv_heads = product
        positions = positions.reshape(-1, 1).expand(x.shape[0], 1)  # [B, 1] from [B, 1], [1, 1] or [1]
        if rotary_step.step_fast_path(qkv, heads, kv_heads, positions):
            q, stacked = rotary_step.rotate_step(qkv, heads, kv_heads, self.rotary, positions)
        else:
            q, k, v = rotary_step.split_product(qkv, heads, kv_heads)
            q, stacked = self.rotary(q, positions), torch.stack((self.rotary(k, positions), v))
        return self._step_query(q), stacked

    def projections_to_fuse(self) -> tuple[nn.Linear, ...] | None:
        """The projections of x whose stacked weights give ``_self_projections`` in one product
        (queries, keys, values, in that order), or None where the kind computes them otherwise."""
        return None

    # --- rotary positions ---------------------------------------------------------
    def attach_rotary(self, rotary: RotaryEmbedding) -> None:
        """Rotate this sublayer's self-attention queries and keys by their positions (RoPE; the
        model builds one :class:`RotaryEmbedding` and gives it to every layer)."""
        if not self.supports_cache:
            raise MheError(f"attention kind {self.kind!r} mixes whole sequences without queries and keys; "
                           "it takes no rotary positions (use a kind with a KV cache)")
        if rotary.head_dim != self.cfg.head_dim:
            raise MheError(f"rotary embedding for head_dim={rotary.head_dim} given to a sublayer with "
                           f"head_dim={self.cfg.head_dim}")
        self.rotary = rotary

    def _rotate(self, t: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """``t: [B, h, T, d]`` rotated by ``positions``; unchanged without a rotary embedding
        (or for cross-attention keys, which get ``positions=None``)."""
        if self.rotary is None or positions is None:
            return t
        return self.rotary(t, positions)

    # --- hooks -------------------------------------------------------------
    def _queries(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """``[B, T, m] -> [B, h_q, T, d]``; ``positions`` (``[B, T]`` or ``[T]``) are x's."""
        raise NotImplementedError

    def _keys_values(self, src: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, S, m] -> 2 x [B, h_kv, S, d]``; ``positions`` are src's (None for an encoder's
        output read by cross-attention)."""
        raise NotImplementedError

    def _output(self, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask,
                kernel: str) -> torch.Tensor:
        return kernels.attend(q, k, v, mask, dropout_p=self.cfg.dropout if self.training else 0.0, kernel=kernel)

    def _positions(self, x: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        """``[T]``: x's positions when the caller gave none (after what the cache holds)."""
        pos = torch.arange(x.shape[1], device=x.device)
        return pos if cache is None else cache.index + pos

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
        if x.shape[0] == 0 or x.shape[1] == 0:
            raise MheError(f"input must hold at least one sequence of at least one token [B >= 1, T >= 1, "
                           f"d_model={m}], got {tuple(x.shape)}")
        if context is not None and (context.dim() != 3 or context.shape[-1] != m
                                    or context.shape[0] != x.shape[0]):
            raise MheError(f"context must have shape [B={x.shape[0]}, S, d_model={m}], got {tuple(context.shape)}")
        if context is not None and context.shape[1] == 0:
            raise MheError(f"context must hold at least one token to attend to [B, S >= 1, d_model={m}], "
                           f"got {tuple(context.shape)}")

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


def attention_sublayers(module: nn.Module) -> list[Attention]:
    """Every attention sublayer of ``module`` (``module`` itself included), in module order."""
    return [m for m in module.modules() if isinstance(m, Attention)]


def set_kernel(module: nn.Module, name: str) -> nn.Module:
    """Point every attention sublayer of ``module`` at kernel ``name`` (in place; a kernel never
    changes the function, only how it runs): the configured kernel, which the Hugging Face adapter
    sets from ``_attn_implementation``. Decoding never writes its kernel into sublayers: its
    :class:`~mhe.attention.kernels.DecodePlan` is passed down each call."""
    kernels.check_kernel(name)
    for m in attention_sublayers(module):
        if m.cfg.kernel != name:
            m.cfg = dataclasses.replace(m.cfg, kernel=name)
    return module
