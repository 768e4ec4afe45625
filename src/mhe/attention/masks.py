"""What each query may see: built once per forward by the model and handed to every layer.

The model (``Decoder.forward``, ``EncoderDecoder.encode/decode``, ``Encoder.forward``) turns
its key-padding mask and, with a cache, the cache's write position into one
:class:`AttentionMask`, as Hugging Face's ``create_causal_mask`` does; an attention sublayer
called on its own builds the same mask from the same functions (:func:`sublayer_mask`). Every
mask is built here; kernels take the finished :class:`AttentionMask`
(:func:`mhe.attention.kernels.attend`). Attention modules never look at a kernel's name: a
decoding run's :class:`~mhe.attention.kernels.DecodePlan` says which mask form its kernel reads
(``key-range`` for a kernel that reads a run of keys instead of a mask, ``flash-decode`` or
``split-k-decode``, as the kernel registry says: :func:`mhe.attention.kernels.reads_key_range`),
and :func:`self_attention_mask` builds that run for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mhe.attention import kernels
from mhe.attention.kernels import DecodePlan
from mhe.compile_fallback import tracing
from mhe.errors import MheError


@dataclass(frozen=True)
class AttentionMask:
    """What every query of one forward may see.

    Attributes:
        keys: how many leading key positions attention reads (a cache's first ``keys``
            positions; beam search's window); None: every key it is given.
        dense: boolean, broadcastable to ``[B, h, T, keys]``, True = attend; None: every key
            (or, with ``causal``, query i sees keys 0..i).
        causal: with no ``dense`` mask, query i sees keys 0..i (SDPA's ``is_causal``; T == keys).
        key_range: for a kernel that reads runs of keys: ``(cum_seq_k [B + 1], used [B])``
            int32, row b seeing its cache's positions ``[start_b, start_b + used_b)``, and
            ``cum_seq_q [B + 1]`` (:mod:`mhe.attention.flash_decode`).
        padding: the boolean key-padding mask ``[B, keys]`` it was built from (token-mixing
            layers, which have no keys, read this), None without padding.
    """

    keys: int | None = None
    dense: torch.Tensor | None = None
    causal: bool = False
    key_range: tuple[torch.Tensor, ...] | None = None
    padding: torch.Tensor | None = None

    def __post_init__(self) -> None:
        # dtype -> ``dense`` in additive form, made on first use. Deliberately not a dataclass
        # field: FSDP2 rebuilds every block's inputs with ``dataclasses.replace`` (moving them to
        # the device, casting them under its mixed-precision policy), which refuses a field
        # declared ``init=False``; a copy made that way starts with an empty cache of its own.
        object.__setattr__(self, "_additive", {})

    def for_kernel(self, kernel: str, dtype: torch.dtype) -> torch.Tensor | None:
        """``dense`` as ``kernel`` reads it. SDPA turns a boolean mask into an additive one (0 to
        attend, -inf not) in the query's dtype at every call, which in a compiled decode step is
        one kernel a layer; a kernel that takes the additive form
        (:func:`~mhe.attention.kernels.takes_additive_mask`) gets it, made once per forward and
        dtype: the numbers SDPA makes for its math and memory-efficient backends. (For a row that
        may see no key, cuDNN's own conversion, -65504, attends to every key, where -inf gives
        zeros as the other backends do; the masks built here give every row a key.)"""
        if self.dense is None or self.dense.dtype != torch.bool or not kernels.takes_additive_mask(kernel):
            return self.dense
        if dtype not in self._additive:
            self._additive[dtype] = additive_mask(self.dense, dtype)
        return self._additive[dtype]


def additive_mask(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where boolean ``dense`` is True, -inf where not, in ``dtype``.

    Inside ``torch.compile`` this is one opaque operator, so inductor stores its result once: as
    plain arithmetic it would be recomputed into each layer's copy of the mask into the layout
    SDPA's cuDNN kernel wants (one kernel a layer in a decode step), and the store's rows are
    padded to a multiple of 8 elements, the alignment inductor checks before it reads a mask
    in place (its ``sdpa_constraint``)."""
    if torch.compiler.is_compiling():
        return torch.ops.mhe.additive_mask(dense, dtype)
    return _additive_mask(dense, dtype)


@torch.library.custom_op("mhe::additive_mask", mutates_args=())
def _additive_mask_op(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _aligned_empty(dense, dtype).fill_(float("-inf")).masked_fill_(dense, 0.0)


@_additive_mask_op.register_fake
def _(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _aligned_empty(dense, dtype)


def _additive_mask(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(dense.shape, dtype=dtype, device=dense.device).masked_fill(~dense, float("-inf"))


def _aligned_empty(dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor of ``dense``'s shape whose rows start every 8 elements."""
    *lead, n = dense.shape
    padded = -(-n // 8) * 8
    return torch.empty((*lead, padded), dtype=dtype, device=dense.device)[..., :n]


def dense_mask(key_mask: torch.Tensor | None, *, causal: bool, q_len: int, k_len: int,
               offset: int | torch.Tensor = 0, device: torch.device) -> torch.Tensor | None:
    """Boolean mask broadcastable to ``[B, h, T, S]``; True where attention is allowed.

    Query ``i`` sits at absolute position ``offset + i`` (``offset`` may be a 0-d tensor, so
    a decode step has one graph for every position); with ``causal`` it may see keys
    ``0 .. offset + i``. With both ``causal`` and ``key_mask`` a query that would see no
    real key (a left-padding position) sees its own key instead, so its softmax row stays
    finite; every other row is exactly the key-padding mask's.
    """
    mask = None
    if causal:
        qpos = torch.arange(q_len, device=device)[:, None] + offset  # [T, 1]
        kpos = torch.arange(k_len, device=device)[None, :]  # [1, S]
        mask = (kpos <= qpos)[None, None]  # [1, 1, T, S]
        if key_mask is not None:
            allowed = mask & key_mask[:, None, None, :]  # [B, 1, T, S]
            empty = ~allowed.any(-1, keepdim=True)  # [B, 1, T, 1]: a query with no real key to see
            return allowed | (empty & (kpos == qpos)[None, None])
    if key_mask is not None:
        km = key_mask[:, None, None, :]  # [B, 1, 1, S]
        mask = km if mask is None else mask & km
    return mask


def sublayer_mask(x: torch.Tensor, key_mask: torch.Tensor | None, *, context: torch.Tensor | None, cache,
                  causal: bool, plan: DecodePlan) -> AttentionMask:
    """The mask an attention sublayer called on its own (not from a model, which builds one mask
    per forward) applies to its ``x`` ``[B, T, m]``: the same functions a model calls, from the
    boolean key-padding mask ``[B, S]`` it was given (cross-attention: over ``context``; with a
    ``cache``: over the cache, or the positions so far); ``plan``: the mask form its kernel reads."""
    b, t = x.shape[0], x.shape[1]
    if context is not None or (cache is None and not causal):
        return padding_mask(checked_key_mask(key_mask, b, t if context is None else context.shape[1]))
    if cache is None:
        return self_attention_mask(x, checked_key_mask(key_mask, b, t))
    return self_attention_mask(x, key_mask, causal=causal, start=cache.index, keys=cache.max_len, plan=plan)


def checked_key_mask(mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
    """``mask`` when it is a boolean key-padding mask ``[batch, keys]`` (or None); else one line."""
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (batch, keys)):
        raise MheError(f"mask must be a boolean key-padding mask of shape [B={batch}, S={keys}], "
                       f"got {mask.dtype} {tuple(mask.shape)}")
    return mask


def padding_mask(key_mask: torch.Tensor | None) -> AttentionMask:
    """Every query sees every real key: encoder self-attention and cross-attention.
    ``key_mask``: boolean ``[B, S]``, True for real tokens (None: no padding)."""
    return AttentionMask(dense=None if key_mask is None else key_mask[:, None, None, :],  # [B, 1, 1, S]
                         padding=key_mask)


def self_attention_mask(tokens: torch.Tensor, key_mask: torch.Tensor | None, *, causal: bool = True,
                        start: int | torch.Tensor = 0, keys: int | None = None,
                        plan: DecodePlan | None = None) -> AttentionMask:
    """The mask of the T new queries ``tokens`` (``[B, T]`` ids or ``[B, T, m]``) at positions
    ``start ..`` over ``keys`` key positions.

    Args:
        key_mask: boolean ``[B, keys]`` (True = real token), or ``[B, start + T]`` over the
            positions so far (padded with False to ``keys``); None: no padding.
        causal: a query sees no later key (else every key written so far).
        start: position of the first new query in the keys: 0 without a cache, the cache's write
            position (a 0-d tensor, so a decode step is one graph for every position) with one.
        keys: key positions read (a cache's length, or a window of it); default ``start + q_len``.
        plan: the decoding run's plan; its ``key-range`` form gets a run of keys per row for a
            single causal query (the precondition, one contiguous run of keys per row, holds for
            left padding: :mod:`mhe.attention.flash_decode`); None: the dense form.

    A prompt into an empty cache (``start`` the int 0) with no padding reads only its own
    keys under SDPA's plain causal path, the fast prefill.
    """
    b, q_len, dev = tokens.shape[0], tokens.shape[1], tokens.device
    static_start = isinstance(start, int)
    if keys is None:
        if not static_start:
            raise MheError("self_attention_mask needs keys= when start is a tensor")
        keys = start + q_len
    if causal and key_mask is None and static_start and start == 0:
        return AttentionMask(keys=q_len, causal=True)
    if not tracing() and int(start) + q_len > keys:
        raise MheError(f"KV cache overflow: attention window {keys} too small for position {int(start)} + "
                       f"{q_len} new tokens")
    given, key_mask = key_mask, _cover(key_mask, q_len, start, keys)
    if causal and q_len == 1 and plan is not None and plan.key_range:
        return AttentionMask(keys=keys, key_range=decode_key_range(given, start, keys, batch=b, device=dev),
                             padding=key_mask)
    if causal:
        dense = dense_mask(key_mask, causal=True, q_len=q_len, k_len=keys, offset=start, device=dev)
        return AttentionMask(keys=keys, dense=dense, padding=key_mask)
    written = torch.arange(keys, device=dev) < start + q_len  # [keys]
    dense = written[None, None, None, :]  # [1, 1, 1, keys]
    return AttentionMask(keys=keys, dense=dense if key_mask is None else dense & key_mask[:, None, None, :],
                         padding=key_mask)


def decode_key_range(key_mask: torch.Tensor | None, start: int | torch.Tensor, keys: int, *, batch: int,
                     device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The keys the one causal query at ``start`` sees, as a run per row: ``(cum_seq_k [B + 1],
    used [B])`` int32 over the ``(B*keys, h, d)`` view of the cache (row b's run begins at
    ``b*keys + first_b``, after its left padding, and ends at the query), then ``cum_seq_q
    [B + 1]`` (one query a row), built here once for every layer.

    ``key_mask`` ``[B, keys]``, or ``[B, start + 1]`` over the positions so far (None: no
    padding), must be left padding (False then True in every row). A few elementwise kernels,
    where building the dense mask and reading the run back from it costs more than the split-K
    attention saves.

    Inside ``torch.compile`` (a tensor ``start``) the run is one opaque operator
    (``mhe::decode_key_range``): inductor inlines cheap elementwise results into each consumer,
    and every layer's kernel is an extern consumer, so built as plain tensor code the run was
    recomputed by two small kernels in every layer (60 a step on llama-135m); as one operator
    its few kernels run once a step.
    """
    if torch.compiler.is_compiling() and isinstance(start, torch.Tensor):
        return tuple(torch.ops.mhe.decode_key_range(key_mask, start, keys, batch))
    return _key_range(key_mask, start, keys, batch=batch, device=device)


def _key_range(key_mask, start, keys: int, *, batch: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`decode_key_range`'s tensors, built by plain tensor code."""
    offsets = torch.arange(0, (batch + 1) * keys, keys, dtype=torch.int32, device=device)  # [B + 1]: row starts
    queries = torch.arange(batch + 1, dtype=torch.int32, device=device)  # [B + 1]: cum_seq_q, one query a row
    if key_mask is None:  # every written position: the int32 [B] tensor decides the sum's dtype
        return offsets, torch.ones(batch, dtype=torch.int32, device=device) + start, queries
    first = key_mask.shape[1] - key_mask.sum(-1, dtype=torch.int32)  # [B]: each row's left padding
    return offsets + F.pad(first, (0, 1)), (start + 1 - first).to(torch.int32), queries


@torch.library.custom_op("mhe::decode_key_range", mutates_args=())
def _key_range_op(key_mask: torch.Tensor | None, start: torch.Tensor, keys: int,
                  batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_key_range` as one operator that ``torch.compile`` keeps whole (see :func:`decode_key_range`)."""
    return _key_range(key_mask, start, keys, batch=batch, device=start.device)


@_key_range_op.register_fake
def _(key_mask, start, keys, batch):
    make = lambda n: torch.empty(n, dtype=torch.int32, device=start.device)  # noqa: E731
    return make(batch + 1), make(batch), make(batch + 1)


def _cover(key_mask: torch.Tensor | None, q_len: int, start, keys: int) -> torch.Tensor | None:
    """``key_mask`` over all ``keys`` positions: one over the positions so far gets False after them."""
    if key_mask is None:
        return None
    width = key_mask.shape[-1]
    if width == keys and key_mask.dtype == torch.bool and key_mask.dim() == 2:
        return key_mask
    if key_mask.dtype != torch.bool or key_mask.dim() != 2 or width > keys or (
            not tracing() and width != int(start) + q_len):
        so_far = "" if tracing() else f" or [B, {int(start) + q_len}] (positions so far)"
        raise MheError(f"mask must be a boolean key-padding mask of shape [B={key_mask.shape[0]}, S={keys}] "
                       f"(the cache){so_far}, got {key_mask.dtype} {tuple(key_mask.shape)}")
    return F.pad(key_mask, (0, keys - width), value=False)


def as_bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Accept 0/1 integer masks as well as boolean ones (True = real token)."""
    if mask is None:
        return None
    return mask if mask.dtype == torch.bool else mask != 0
