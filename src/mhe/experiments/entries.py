"""A comparison's entries: an attention kind (``mhe-mul``), or a kind with one named variant of
its options (``mhe-mul psi-then-rope``), so one comparison can hold a kind twice.

The variants are MHE's rotary orders (``attention.options.ROPE_ORDERS``): under rotary positions
the head embeddings act after the rotation (``rope-then-psi``, the default: one shared K/V
head) or before it (``psi-then-rope``: a cache of n heads). An entry's runs live in
``runs/ENTRY-seedS`` with the space written as a hyphen (``mhe-mul-psi-then-rope-seed0``).

A finished run's row in the summary is named from what it ran (its ``config.json``), not from
the entry that asked for it: the kind, and for a kind with a rotary order under rotary
positions, the order (``mhe-mul rope-then-psi``), so two orders never share a row and a
comparison summarised again (``mhe report``) names its rows the same way.
"""

from __future__ import annotations

import dataclasses

from mhe.attention.options import KINDS, ROPE_ORDERS, options_class
from mhe.errors import MheError, one_of


def _has_rope_order(kind: str) -> bool:
    return any(f.name == "rope_order" for f in dataclasses.fields(options_class(kind)))


def split_entry(entry: str) -> tuple[str, list[str]]:
    """``(kind, --set items)`` of an entry: ``"mhe-mul psi-then-rope"`` ->
    ``("mhe-mul", ["model.attn_options.rope_order=psi-then-rope"])``."""
    kind, _, variant = entry.strip().partition(" ")
    if kind not in KINDS:
        raise one_of("attention kind", kind, KINDS)
    variant = variant.strip()
    if not variant:
        return kind, []
    if not _has_rope_order(kind):
        raise MheError(f"comparison entry {entry!r}: kind {kind!r} has no variants; give the kind alone")
    if variant not in ROPE_ORDERS:
        raise one_of(f"variant of {kind!r}", variant, ROPE_ORDERS)
    return kind, [f"model.attn_options.rope_order={variant}"]


def entry_kind(entry: str) -> str:
    """The attention kind of an entry."""
    return split_entry(entry)[0]


def entry_dir(entry: str) -> str:
    """The entry as a run-folder name: ``mhe-mul psi-then-rope`` -> ``mhe-mul-psi-then-rope``."""
    split_entry(entry)
    return "-".join(entry.split())


def parse_entries(spec: str, *, what: str = "--kinds") -> tuple[str, ...]:
    """A comma-separated list of entries (``mha,mhe-mul psi-then-rope``), each checked."""
    entries = tuple(" ".join(e.split()) for e in spec.split(",") if e.strip())
    if not entries:
        raise MheError(f"{what} {spec!r} names no attention kind; give a comma-separated list of "
                       f"{', '.join(KINDS)} (MHE kinds may add a rotary order: 'mhe-mul psi-then-rope')")
    for e in entries:
        split_entry(e)
    if len(set(entries)) < len(entries):
        raise MheError(f"{what} {spec!r} names an entry twice")
    return entries


def row_name(model: dict) -> str:
    """The summary row of a run whose resolved model (``config.json``'s ``model``) is ``model``:
    its kind, and for a kind with a rotary order under rotary positions, the order."""
    kind = model["attention"]
    if model.get("positions") != "rotary" or kind not in KINDS or not _has_rope_order(kind):
        return kind
    order = (model.get("attn_options") or {}).get("rope_order", options_class(kind)().rope_order)
    return f"{kind} {order}"


def base_kind(name: str) -> str:
    """The attention kind of a row or entry name (its first word)."""
    return name.split(" ", 1)[0]
