"""Name -> attention class. Names are exactly the paper's labels (section 4.1, Appendix A).

This module holds only the table and its decorator; the variant modules register themselves
with :func:`register`, and the package (``mhe/attention/__init__.py``) imports every variant
module, so importing anything from ``mhe.attention`` fills the table."""

from __future__ import annotations

import dataclasses

from mhe.errors import MheError, one_of

KINDS: tuple[str, ...] = ("mha", "sha", "mqa", "gqa", "skv", "el-att", "mhe-add", "mhe-mul", "fnet", "linear")
"""Every attention kind, in the order tables list them."""

PAPER_KINDS: tuple[str, ...] = ("sha", "mha", "el-att", "mqa", "skv", "mhe-add", "mhe-mul")
"""The seven kinds of the paper's main tables (Tables 1-3), in their row order."""

_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator adding an attention kind under its paper label."""
    def deco(cls):
        if name not in KINDS:
            raise MheError(f"attention kind {name!r} is not one of the known labels {KINDS}")
        cls.kind = name
        _REGISTRY[name] = cls
        return cls
    return deco


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


def attention_class(kind: str):
    if kind not in _REGISTRY:
        raise one_of("attention kind", kind, KINDS)
    return _REGISTRY[kind]


def make_config(kind: str, *, d_model: int, n_heads: int, head_dim: int | None = None, **options):
    """Validate options for ``kind`` and return its config dataclass."""
    cls = attention_class(kind)
    allowed = cls.config_class.option_names()
    bad = sorted(set(options) - set(allowed))
    if bad:
        extra = [a for a in allowed if a not in ("d_model", "n_heads", "head_dim")]
        raise MheError(f"attention kind {kind!r} takes no option {bad[0]!r}; valid options: {', '.join(extra)}")
    return cls.config_class(d_model=d_model, n_heads=n_heads, head_dim=head_dim, **options)


def build_attention(kind: str, *, d_model: int, n_heads: int, head_dim: int | None = None, **options):
    """Build one attention sublayer of the given kind.

    Args:
        kind: one of :data:`KINDS`.
        d_model: model width m.
        n_heads: heads n (SHA keeps n for its output projection, see ``sha``).
        head_dim: per-head width d (default m / n).
        **options: ``bias``, ``dropout``, ``causal`` for every kind; ``n_kv_heads``
            (gqa); ``max_len`` (linear); ``impl``, ``init_std``, ``query_fold`` (mhe-*).
    """
    cfg = make_config(kind, d_model=d_model, n_heads=n_heads, head_dim=head_dim, **options)
    return attention_class(kind)(cfg)


def accepts_option(kind: str, name: str) -> bool:
    return name in attention_class(kind).config_class.option_names()


def config_fields(kind: str) -> list[dataclasses.Field]:
    return list(dataclasses.fields(attention_class(kind).config_class))

