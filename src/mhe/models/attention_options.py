"""Typed per-kind attention options, the ``model.attn_options.*`` settings.

Each kind's own knobs (paper section 4.1, Appendix A) beside the ones every kind
shares (width, heads, dropout, bias, causal; see :class:`mhe.attention.AttentionConfig`):

* ``gqa``: ``n_kv_heads``, the key/value heads g (Ainslie et al. 2023);
* ``mhe-add`` / ``mhe-mul``: ``impl``, ``init_std``, ``query_fold`` (section 3), ``rope_order``;
* ``linear``: ``max_len``, the side of the sequence-mixing matrix (default: the model's);
* every other kind takes none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mhe.attention.mhe import IMPLS, QUERY_FOLDS, ROPE_ORDERS
from mhe.settings import setting, typed_options


@dataclass(frozen=True)
class NoOptions:
    """mha, sha, mqa, skv, el-att and fnet: nothing beyond the shared settings."""


@dataclass(frozen=True)
class GroupedQueryOptions:
    """gqa: ``n_kv_heads`` key/value heads, which must divide ``n_heads``; 0 picks the one
    default used everywhere (:func:`mhe.attention.multi_head.default_kv_heads`: the largest
    divisor of ``n_heads`` not above n/4)."""

    n_kv_heads: int = setting(0, ge=0)


@dataclass(frozen=True)
class MHEOptions:
    """mhe-add / mhe-mul: the fast (multi-query cost) or literal implementation, the
    head-embedding initialisation, how the fast path applies query factors, and under rotary
    positions whether the head embeddings act after the rotation (``rope-then-psi``: one K/V
    head) or before it (``psi-then-rope``: n K/V heads)."""

    impl: Literal[IMPLS] = "fast"
    init_std: float = setting(0.02, ge=0)
    query_fold: Literal[QUERY_FOLDS] = "weight"
    rope_order: Literal[ROPE_ORDERS] = "rope-then-psi"


@dataclass(frozen=True)
class LinearOptions:
    """linear: the sequence-mixing matrix is max_len x max_len (None: the model's max_len)."""

    max_len: int | None = setting(None, gt=0)


OPTION_CLASSES: dict[str, type] = {"gqa": GroupedQueryOptions, "mhe-add": MHEOptions, "mhe-mul": MHEOptions,
                                   "linear": LinearOptions}


def options_class(kind: str) -> type:
    """The options dataclass of an attention kind."""
    return OPTION_CLASSES.get(kind, NoOptions)


def attention_options(kind: str, value: object = None, *, key: str = "model.attn_options"):
    """``value`` (None, a dict, or another kind's options) as ``kind``'s typed options
    (see :func:`mhe.settings.typed_options`)."""
    return typed_options(options_class(kind), value, key, f"attention kind {kind!r}")
