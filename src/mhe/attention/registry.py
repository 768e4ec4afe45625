"""Name -> attention class. Names are exactly the paper's labels (section 4.1, Appendix A).

The table is written out below; each class names the kinds it builds with their options
dataclass (``kind_options``: ``mha``, ``mqa`` and ``gqa`` are one class that differs only in
its key/value heads). A kind's options are the typed ``model.attn_options`` of a run.
"""

from __future__ import annotations

import dataclasses

from mhe.attention.base import Attention, AttentionConfig
from mhe.attention.el_attention import ELAttention
from mhe.attention.mhe import MHEAdd, MHEMul
from mhe.attention.mixing import FNetMixing, LinearMixing
from mhe.attention.multi_head import GroupedQueryAttention, SharedKeyValueAttention
from mhe.attention.single_head import SingleHeadAttention
from mhe.errors import MheError, one_of

ATTENTION_CLASSES: dict[str, type[Attention]] = {
    "mha": GroupedQueryAttention,
    "sha": SingleHeadAttention,
    "mqa": GroupedQueryAttention,
    "gqa": GroupedQueryAttention,
    "skv": SharedKeyValueAttention,
    "el-att": ELAttention,
    "mhe-add": MHEAdd,
    "mhe-mul": MHEMul,
    "fnet": FNetMixing,
    "linear": LinearMixing,
}
"""Every attention kind and the class that builds it, in the order tables list them."""

KINDS: tuple[str, ...] = tuple(ATTENTION_CLASSES)
"""Every attention kind, in the order tables list them."""

PAPER_KINDS: tuple[str, ...] = ("sha", "mha", "el-att", "mqa", "skv", "mhe-add", "mhe-mul")
"""The seven kinds of the paper's main tables (Tables 1-3), in their row order."""

SIZES = ("d_model", "n_heads", "head_dim")
SHARED_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AttentionConfig)
                                        if f.name not in SIZES + ("options",))
"""The options every kind takes (``dropout``, ``causal``, ``bias``, ``qkv_bias``, ``kernel``)."""


def parse_kinds(spec: str, *, what: str = "--kinds") -> tuple[str, ...]:
    """A comma-separated list of kinds, ``paper`` (the seven of Tables 1-3) or ``all``."""
    if spec == "paper":
        return PAPER_KINDS
    if spec == "all":
        return KINDS
    kinds = tuple(k.strip() for k in spec.split(",") if k.strip())
    if not kinds:
        raise MheError(f"{what} {spec!r} names no attention kind; give paper, all or a comma-separated list of "
                       f"{', '.join(KINDS)}")
    for k in kinds:
        if k not in KINDS:
            raise one_of("attention kind", k, KINDS)
    return kinds


def attention_class(kind: str) -> type[Attention]:
    if kind not in ATTENTION_CLASSES:
        raise one_of("attention kind", kind, KINDS)
    return ATTENTION_CLASSES[kind]


def options_class(kind: str) -> type:
    """The options dataclass of an attention kind (``model.attn_options``)."""
    return attention_class(kind).kind_options[kind]


def make_config(kind: str, *, d_model: int, n_heads: int, head_dim: int | None = None, **options) -> AttentionConfig:
    """Validate ``options`` for ``kind`` (the shared ones and the kind's own) and return its config."""
    own_class = options_class(kind)
    own_names = tuple(f.name for f in dataclasses.fields(own_class))
    bad = sorted(set(options) - set(SHARED_OPTIONS) - set(own_names))
    if bad:
        raise MheError(f"attention kind {kind!r} takes no option {bad[0]!r}; valid options: "
                       f"{', '.join(SHARED_OPTIONS + own_names)}")
    own = own_class(**{k: v for k, v in options.items() if k in own_names})
    shared = {k: v for k, v in options.items() if k in SHARED_OPTIONS}
    return AttentionConfig(d_model=d_model, n_heads=n_heads, head_dim=head_dim, options=own, **shared)


def build_attention(kind: str, *, d_model: int, n_heads: int, head_dim: int | None = None, **options) -> Attention:
    """Build one attention sublayer of the given kind.

    Args:
        kind: one of :data:`KINDS`.
        d_model: model width m.
        n_heads: heads n (SHA keeps n for its output projection, see ``sha``).
        head_dim: per-head width d (default m / n).
        **options: ``bias``, ``dropout``, ``causal``, ``kernel`` for every kind, and the
            fields of the kind's options dataclass (:func:`options_class`): ``n_kv_heads``
            (gqa), ``max_len`` (linear), ``impl``, ``init_std``, ``query_fold``, ``rope_order`` (mhe-*).
    """
    return attention_from_config(kind, make_config(kind, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                                                   **options))


def attention_from_config(kind: str, cfg: AttentionConfig) -> Attention:
    """One attention sublayer of ``kind`` built with its typed configuration as it is (a model's
    sublayers: :meth:`mhe.models.ModelConfig.attention_config`)."""
    return attention_class(kind)(cfg, kind=kind)
