"""One typed spec per attention kind, in one registry (:data:`SPECS`), without torch.

A kind's name is text only at the edge (``--attention``, ``--set model.attn_options.*``, a
comparison entry, ``mhe convert``'s target, a ``config.json``); :func:`attention_spec` turns it
into its :class:`AttentionSpec` once, and the rest of the code asks the spec
(``spec.cache_heads(...)``, ``spec.is_mhe``, ``spec.folds``) instead of comparing names. A new
kind is one new entry in :data:`SPECS` and its sublayer class.

The spec names its sublayer class by import path (``layer``), so ``mhe params``, ``mhe memory``
and the model configuration read the table without importing torch; :attr:`AttentionSpec.layer_class`
imports it on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable

from mhe.attention.options import (
    AttentionConfig,
    GroupedQueryOptions,
    LinearOptions,
    MHEOptions,
    NoOptions,
    default_kv_heads,
)
from mhe.errors import MheError, one_of
from mhe.settings import typed_options


def _all_heads(n_heads: int, options: object) -> int:
    return n_heads


def _one_head(n_heads: int, options: object) -> int:
    return 1


def _grouped(n_heads: int, options: object) -> int:
    """gqa's ``n_kv_heads`` (0: :func:`~mhe.attention.options.default_kv_heads`), which must divide n."""
    g = options.n_kv_heads or default_kv_heads(n_heads)
    if n_heads % g:
        raise MheError(f"n_kv_heads={g} must divide n_heads={n_heads}")
    return g


def _no_heads(n_heads: int, options: object) -> int:
    return 0


@dataclass(frozen=True, kw_only=True)
class AttentionSpec:
    """What one attention kind is, in one place.

    Attributes:
        name: the kind's name, exactly the paper's label (``mhe-mul``); what ``config.json`` holds.
        display: the paper's printed name (``MHE-Mul``), for tables and figures.
        options: the kind's options dataclass (``model.attn_options``).
        layer: the sublayer class, as ``module:Class`` (imported on first use: :attr:`layer_class`).
        kv_rule: the key/value heads g of its projections for (n_heads, options): n, 1 or gqa's
            ``n_kv_heads`` (0 for the mixing kinds, which have none).
        projections: the output widths of its input projections for (n, d, g) (queries first).
        psi: MHE's head-embedding operation, ``"add"`` or ``"mul"``; ``""`` for other kinds.
        single_head: one query head of width d (SHA; its output tiled n times, section 4.1).
        causal: can mask future positions (a decoder's self-attention); FNet's Fourier transform
            sees every position and cannot.
        mixes: mixes whole sequences (FNet, Linear): no queries or keys, no KV cache, no
            cross-attention, no rotary positions, no output projection.
        folds_to: the kind an inference view folds its sublayers into (MHE: ``mqa``), or None.
        own_params: the parameter count of a kind without projections (the mixing kinds), in
            place of the projection formula of :meth:`params`.
    """

    name: str
    display: str
    options: type
    layer: str
    kv_rule: Callable[[int, object], int]
    projections: Callable[[int, int, int], tuple[int, ...]] = lambda n, d, g: ()
    psi: str = ""
    single_head: bool = False
    causal: bool = True
    mixes: bool = False
    folds_to: str | None = None
    own_params: Callable[[AttentionConfig], int] | None = None

    def __reduce__(self):
        """Pickled as its name, unpickled as the registry's own spec (a pickled model's sublayers
        keep ``spec is SPECS[kind]``); a copy is the spec itself (:meth:`__deepcopy__`), as a
        model's sublayers deep-copied into an inference view keep it."""
        return attention_spec, (self.name,)

    def __copy__(self) -> "AttentionSpec":
        return self  # frozen and the registry's own: a copy is the spec itself, no lookup by name

    def __deepcopy__(self, memo) -> "AttentionSpec":
        return self

    @property
    def is_mhe(self) -> bool:
        """Multi-head embedding attention (MHE-Add or MHE-Mul)."""
        return bool(self.psi)

    @property
    def grouped(self) -> bool:
        """Whether its options choose the key/value heads (gqa's ``n_kv_heads``)."""
        return any(f.name == "n_kv_heads" for f in dataclasses.fields(self.options))

    @property
    def head_groups(self) -> bool:
        """n query heads over g key/value heads, each with its own K and V projection (mha, mqa,
        gqa): the attention of the multi-head checkpoints a conversion or a Llama export reads."""
        return self.projections is _heads_qkv

    @property
    def folds(self) -> bool:
        """Whether an inference view folds this kind's sublayers into another kind (:attr:`folds_to`)."""
        return self.folds_to is not None

    @property
    def has_cache(self) -> bool:
        """Whether its sublayers keep a KV cache (every kind but the mixing ones)."""
        return not self.mixes

    @property
    def layer_class(self) -> type:
        """The sublayer class (imports torch)."""
        module, _, cls = self.layer.partition(":")
        return getattr(importlib.import_module(module), cls)

    def kv_heads(self, n_heads: int, options: object) -> int:
        """The key/value heads g of its projections: n (``mha``, ``skv``, ``el-att``), 1
        (``mqa``, ``sha``, MHE's one shared head), gqa's ``n_kv_heads``, 0 (mixing kinds)."""
        return self.kv_rule(n_heads, options)

    def cache_heads(self, n_heads: int, options: object, *, rotary: bool = False) -> int:
        """The key/value heads its KV cache holds (the one rule; each sublayer's ``cache_heads``
        and ``mhe memory`` ask it): :meth:`kv_heads`, except MHE computed head by head
        (``impl="reference"``, or ``psi-then-rope`` under rotary positions), which caches n."""
        if self.is_mhe and self.literal(options, rotary=rotary):
            return n_heads
        return self.kv_heads(n_heads, options)

    def literal(self, options: object, *, rotary: bool) -> bool:
        """MHE computing n explicit heads: the reference, or psi before RoPE under rotary positions."""
        return self.is_mhe and (options.impl == "reference" or (rotary and options.rope_order == "psi-then-rope"))

    def params(self, cfg: AttentionConfig, *, include_output: bool = True) -> int:
        """The analytic parameter count of one sublayer configured by ``cfg``
        (:func:`mhe.accounting.params.attention_params` documents the formulas)."""
        if self.own_params is not None:
            return self.own_params(cfg)
        m, n, d, bias = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.bias
        widths = self.projections(n, d, self.kv_heads(n, cfg.options))
        total = sum(m * w + (w if cfg.in_bias else 0) for w in widths)
        if self.is_mhe:
            total += 3 * n * d  # the head embeddings
        if include_output:
            total += n * d * m + (m if bias else 0)
        return total

    @property
    def has_rope_order(self) -> bool:
        """Whether its options name an order of the head embeddings and RoPE (MHE's ``rope_order``)."""
        return any(f.name == "rope_order" for f in dataclasses.fields(self.options))

    def row_name(self, options: object, *, rotary: bool) -> str:
        """Its row in a comparison's tables: the name, and for a kind with a rotary order under
        rotary positions, the order (``mhe-mul rope-then-psi``), so two orders never share a row."""
        return f"{self.name} {options.rope_order}" if rotary and self.has_rope_order else self.name

    def make_options(self, value: object = None) -> object:
        """``value`` (None, a dict or an options dataclass) as this kind's options, checked."""
        return typed_options(self.options, value, "model.attn_options", f"attention kind {self.name!r}")


def _linear_params(cfg: AttentionConfig) -> int:
    """Linear mixing: max_len^2 (sequence) + m^2 (hidden) + m with a bias; no output projection."""
    m = cfg.d_model
    return cfg.options.resolved_max_len ** 2 + m * m + (m if cfg.bias else 0)


def _heads_qkv(n, d, g):
    return (n * d, g * d, g * d)


def _seed_qkv(n, d, g):
    return (d, d, d)


_GQA = "mhe.attention.multi_head:GroupedQueryAttention"
_SPECS = (
    AttentionSpec(name="mha", display="MHA", options=NoOptions, layer=_GQA, kv_rule=_all_heads,
                  projections=_heads_qkv),
    AttentionSpec(name="sha", display="SHA", options=NoOptions, layer="mhe.attention.single_head:SingleHeadAttention",
                  kv_rule=_one_head, projections=_seed_qkv, single_head=True),
    AttentionSpec(name="mqa", display="MQA", options=NoOptions, layer=_GQA, kv_rule=_one_head,
                  projections=_heads_qkv),
    AttentionSpec(name="gqa", display="GQA", options=GroupedQueryOptions, layer=_GQA, kv_rule=_grouped,
                  projections=_heads_qkv),
    AttentionSpec(name="skv", display="SKV", options=NoOptions,
                  layer="mhe.attention.multi_head:SharedKeyValueAttention", kv_rule=_all_heads,
                  projections=lambda n, d, g: (n * d, n * d)),
    AttentionSpec(name="el-att", display="EL-att", options=NoOptions, layer="mhe.attention.el_attention:ELAttention",
                  kv_rule=_all_heads, projections=lambda n, d, g: (n * d,)),
    AttentionSpec(name="mhe-add", display="MHE-Add", options=MHEOptions, layer="mhe.attention.mhe:MHEAdd",
                  kv_rule=_one_head, projections=_seed_qkv, psi="add", folds_to="mqa"),
    AttentionSpec(name="mhe-mul", display="MHE-Mul", options=MHEOptions, layer="mhe.attention.mhe:MHEMul",
                  kv_rule=_one_head, projections=_seed_qkv, psi="mul", folds_to="mqa"),
    AttentionSpec(name="fnet", display="FNet", options=NoOptions, layer="mhe.attention.mixing:FNetMixing",
                  kv_rule=_no_heads, causal=False, mixes=True, own_params=lambda cfg: 0),
    AttentionSpec(name="linear", display="Linear", options=LinearOptions, layer="mhe.attention.mixing:LinearMixing",
                  kv_rule=_no_heads, mixes=True, own_params=_linear_params),
)

SPECS: dict[str, AttentionSpec] = {s.name: s for s in _SPECS}
"""Every attention kind's spec by name, in the order tables list them: the one registry."""

KINDS: tuple[str, ...] = tuple(SPECS)
"""Every attention kind, in the order tables list them."""

PAPER_KINDS: tuple[str, ...] = ("sha", "mha", "el-att", "mqa", "skv", "mhe-add", "mhe-mul")
"""The seven kinds of the paper's main tables (Tables 1-3), in their row order."""


def attention_spec(kind: str | AttentionSpec) -> AttentionSpec:
    """The spec of a kind named ``kind`` (a spec is returned as it is); an unknown name is a
    one-line error listing the kinds."""
    if isinstance(kind, AttentionSpec):
        return kind
    if kind not in SPECS:
        raise one_of("attention kind", kind, KINDS)
    return SPECS[kind]


def specs_of(cls: type) -> tuple[AttentionSpec, ...]:
    """The kinds whose sublayer class is ``cls`` (its own kinds first; the first is its default)."""
    path = f"{cls.__module__}:{cls.__qualname__}"
    return tuple(s for s in _SPECS if s.layer == path)


SIZES = ("d_model", "n_heads", "head_dim")
SHARED_OPTIONS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(AttentionConfig)
                                        if f.name not in SIZES + ("options",))
"""The options every kind takes (``dropout``, ``causal``, ``bias``, ``qkv_bias``, ``kernel``)."""


def parse_specs(text: str, *, what: str = "--kinds") -> tuple[AttentionSpec, ...]:
    """A comma-separated list of kinds, ``paper`` (the seven of Tables 1-3) or ``all``, parsed
    into their specs (the one parse of a command's ``--kinds``)."""
    if text in ("paper", "all"):
        return tuple(SPECS[k] for k in (PAPER_KINDS if text == "paper" else KINDS))
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    if not kinds:
        raise MheError(f"{what} {text!r} names no attention kind; give paper, all or a comma-separated list of "
                       f"{', '.join(KINDS)}")
    return tuple(attention_spec(k) for k in kinds)


def parse_kinds(spec: str, *, what: str = "--kinds") -> tuple[str, ...]:
    """A comma-separated list of kinds, ``paper`` (the seven of Tables 1-3) or ``all``, checked:
    their names (:func:`parse_specs` gives their specs)."""
    if spec == "paper":
        return PAPER_KINDS
    if spec == "all":
        return KINDS
    return tuple(s.name for s in parse_specs(spec, what=what))


def options_class(kind: str) -> type:
    """The options dataclass of an attention kind (``model.attn_options``)."""
    return attention_spec(kind).options


def kv_heads(kind: str, n_heads: int, options: object) -> int:
    """The key/value heads g of a kind's projections (:meth:`AttentionSpec.kv_heads`)."""
    return attention_spec(kind).kv_heads(n_heads, options)


def cache_heads(kind: str, n_heads: int, options: object, *, rotary: bool = False) -> int:
    """The key/value heads a kind's KV cache holds (:meth:`AttentionSpec.cache_heads`)."""
    return attention_spec(kind).cache_heads(n_heads, options, rotary=rotary)


def make_config(kind: str | AttentionSpec, *, d_model: int, n_heads: int, head_dim: int | None = None,
                **options) -> AttentionConfig:
    """Validate ``options`` for ``kind`` (its spec, or its name; the shared options and the kind's
    own) and return its config."""
    spec = attention_spec(kind)
    own_class = spec.options
    own_names = tuple(f.name for f in dataclasses.fields(own_class))
    bad = sorted(set(options) - set(SHARED_OPTIONS) - set(own_names))
    if bad:
        raise MheError(f"attention kind {spec.name!r} takes no option {bad[0]!r}; valid options: "
                       f"{', '.join(SHARED_OPTIONS + own_names)}")
    own = own_class(**{k: v for k, v in options.items() if k in own_names})
    shared = {k: v for k, v in options.items() if k in SHARED_OPTIONS}
    return AttentionConfig(d_model=d_model, n_heads=n_heads, head_dim=head_dim, options=own, **shared)
