"""Name -> attention class. Names are exactly the paper's labels (section 4.1, Appendix A).

The table is written out below; each class names the kinds it builds with their options
dataclass (``kind_options``: ``mha``, ``mqa`` and ``gqa`` are one class that differs only in
its key/value heads). A kind's options are the typed ``model.attn_options`` of a run; the names,
options and config live without torch in :mod:`mhe.attention.options`, whose ``KIND_OPTIONS``
must agree with the classes (checked below, at import).
"""

from __future__ import annotations

from mhe.attention.base import Attention
from mhe.attention.options import (  # noqa: F401 (re-exported: the names, without torch)
    KIND_OPTIONS,
    KINDS,
    PAPER_KINDS,
    SHARED_OPTIONS,
    AttentionConfig,
    make_config,
    options_class,
    parse_kinds,
)
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

if tuple(ATTENTION_CLASSES) != KINDS or any(ATTENTION_CLASSES[k].kind_options.get(k) is not KIND_OPTIONS[k]
                                            for k in KINDS):
    raise MheError("attention.options.KIND_OPTIONS and the classes' kind_options disagree; keep them one table")


def attention_class(kind: str) -> type[Attention]:
    if kind not in ATTENTION_CLASSES:
        raise one_of("attention kind", kind, KINDS)
    return ATTENTION_CLASSES[kind]


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
