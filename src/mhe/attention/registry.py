"""Name -> attention sublayer. Names are exactly the paper's labels (section 4.1, Appendix A).

The one table of kinds is :data:`mhe.attention.spec.SPECS` (without torch): each kind's spec
names its options dataclass and its class (``mha``, ``mqa`` and ``gqa`` are one class that
differs only in its key/value heads). This module builds the sublayers from it.
"""

from __future__ import annotations

from mhe.attention.base import Attention
from mhe.attention.options import AttentionConfig
from mhe.attention.spec import (  # noqa: F401 (re-exported: the names, without torch)
    KINDS,
    PAPER_KINDS,
    SHARED_OPTIONS,
    AttentionSpec,
    attention_spec,
    make_config,
    options_class,
    parse_kinds,
)


def attention_class(kind: str | AttentionSpec) -> type[Attention]:
    """The sublayer class of a kind (its spec's ``layer_class``)."""
    return attention_spec(kind).layer_class


def build_attention(kind: str | AttentionSpec, *, d_model: int, n_heads: int, head_dim: int | None = None,
                    **options) -> Attention:
    """Build one attention sublayer of the given kind.

    Args:
        kind: one of :data:`KINDS`, or its spec.
        d_model: model width m.
        n_heads: heads n (SHA keeps n for its output projection, see ``sha``).
        head_dim: per-head width d (default m / n).
        **options: ``bias``, ``dropout``, ``causal``, ``kernel`` for every kind, and the
            fields of the kind's options dataclass (:func:`options_class`): ``n_kv_heads``
            (gqa), ``max_len`` (linear), ``impl``, ``init_std``, ``query_fold``, ``rope_order`` (mhe-*).
    """
    spec = attention_spec(kind)
    return attention_from_config(spec, make_config(spec.name, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                                                   **options))


def attention_from_config(kind: str | AttentionSpec, cfg: AttentionConfig) -> Attention:
    """One attention sublayer of ``kind`` built with its typed configuration as it is (a model's
    sublayers: :meth:`mhe.models.ModelConfig.attention_config`)."""
    spec = attention_spec(kind)
    return spec.layer_class(cfg, kind=spec.name)
