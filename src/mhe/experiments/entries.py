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
from dataclasses import dataclass

from mhe.attention.options import ROPE_ORDERS
from mhe.attention.spec import KINDS, AttentionSpec, attention_spec
from mhe.errors import MheError, one_of


@dataclass(frozen=True)
class Entry:
    """One comparison entry, parsed: its kind's spec and, for MHE, the rotary order it asks for
    (``""``: the kind's default options)."""

    spec: AttentionSpec
    rope_order: str = ""

    def __str__(self) -> str:
        """The entry as written (``mhe-mul psi-then-rope``): its name in logs and sweep.json."""
        return f"{self.spec.name} {self.rope_order}" if self.rope_order else self.spec.name

    @property
    def dir(self) -> str:
        """The entry as a run-folder name: ``mhe-mul psi-then-rope`` -> ``mhe-mul-psi-then-rope``."""
        return str(self).replace(" ", "-")

    @property
    def base(self) -> "Entry":
        """The entry's kind alone, with its default options (what a task's defaults are built for)."""
        return Entry(self.spec)

    def apply(self, cfg):
        """``cfg`` (a :class:`~mhe.training.config.RunConfig`) with its model set to this entry's
        variant: the typed options changed in place of a ``--set`` item parsed again."""
        if self.rope_order:
            opts = dataclasses.replace(cfg.model.attn_options, rope_order=self.rope_order)
            cfg.model = cfg.model.replace(attn_options=opts)
        return cfg


def parse_entry(entry: str | Entry) -> Entry:
    """An entry's text as its :class:`Entry`: ``"mhe-mul psi-then-rope"`` ->
    ``Entry(spec of mhe-mul, rope_order="psi-then-rope")``; an :class:`Entry` is returned as it is."""
    if isinstance(entry, Entry):
        return entry
    kind, _, variant = entry.strip().partition(" ")
    spec = attention_spec(kind)
    variant = variant.strip()
    if not variant:
        return Entry(spec)
    if not spec.has_rope_order:
        raise MheError(f"comparison entry {entry!r}: kind {kind!r} has no variants; give the kind alone")
    if variant not in ROPE_ORDERS:
        raise one_of(f"variant of {kind!r}", variant, ROPE_ORDERS)
    return Entry(spec, variant)


def entry_kind(entry: str) -> str:
    """The attention kind of an entry."""
    return parse_entry(entry).spec.name


def entry_dir(entry: str | Entry) -> str:
    """The entry as a run-folder name: ``mhe-mul psi-then-rope`` -> ``mhe-mul-psi-then-rope``."""
    return parse_entry(entry).dir


def parse_entries(spec: str, *, what: str = "--kinds") -> tuple[str, ...]:
    """A comma-separated list of entries (``mha,mhe-mul psi-then-rope``), each checked."""
    entries = tuple(" ".join(e.split()) for e in spec.split(",") if e.strip())
    if not entries:
        raise MheError(f"{what} {spec!r} names no attention kind; give a comma-separated list of "
                       f"{', '.join(KINDS)} (MHE kinds may add a rotary order: 'mhe-mul psi-then-rope')")
    for e in entries:
        parse_entry(e)
    if len(set(entries)) < len(entries):
        raise MheError(f"{what} {spec!r} names an entry twice")
    return entries


def row_name(model: dict) -> str:
    """The summary row of a run whose resolved model (``config.json``'s ``model``) is ``model``:
    its kind, and for a kind with a rotary order under rotary positions, the order
    (:meth:`~mhe.attention.spec.AttentionSpec.row_name`)."""
    kind = model["attention"]
    if kind not in KINDS:
        return kind
    spec = attention_spec(kind)
    options = None
    if spec.has_rope_order:  # only the order is read: a run folder's other options stay as written
        given = (model.get("attn_options") or {}).get("rope_order", spec.options().rope_order)
        options = spec.options(rope_order=given)
    return spec.row_name(options, rotary=model.get("positions") == "rotary")


def base_kind(name: str) -> str:
    """The attention kind of a row or entry name (its first word)."""
    return name.split(" ", 1)[0]
