"""The converted sublayers' options: the target kind's ``model.attn_options`` (GQA's K/V heads,
MHE's ``rope_order``, ...), from ``--n-kv-heads`` and ``--set model.attn_options.KEY=VALUE``.

A conversion changes the attention kind and nothing else, so ``--set`` takes only the target
kind's own options; every other setting is the source's (its shapes are the fitted weights').
The target kinds, what each fit minimises and the splits scored live here, without torch, for
``mhe convert --help``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mhe.attention.spec import AttentionSpec, attention_spec
from mhe.errors import MheError
from mhe.settings import set_path

TARGETS = ("mhe-mul", "mhe-add", "mqa", "gqa", "sha")
"""The kinds a multi-head model converts to."""

MINIMISES = {"mhe-mul": "query, key and value projections (weights)",
             "mhe-add": "query, key and value projections (on calibration outputs)",
             "mqa": "key and value projections (weights; mean pooling)",
             "gqa": "key and value projections (weights; mean pooling)",
             "sha": "logits and value-output maps (weights; the heads' mean and sum)"}
"""What each kind's fit minimises exactly: those errors can never exceed the naive ones."""

FITS = ("weights", "outputs")
"""``mhe convert --fit``: the weight fit alone, or followed by the output fit (each sublayer
fitted to the source's sublayer outputs on calibration tokens, :mod:`mhe.convert.outputs`)."""

SPLITS = ("valid", "test")
"""The held-out splits a conversion scores."""

PREFIX = "model.attn_options."


def target_spec(kind: str | AttentionSpec) -> AttentionSpec:
    """The spec of the conversion target ``kind``: a name (``mhe convert --attention``) is parsed
    here, once, and the spec is what the conversion passes down; a spec is returned as it is.
    Anything but one of :data:`TARGETS` is a one-line error listing them."""
    name = kind.name if isinstance(kind, AttentionSpec) else kind
    if name not in TARGETS:
        raise MheError(f"cannot convert to attention kind {name!r}; valid targets: {', '.join(TARGETS)}")
    return attention_spec(kind)


def parse_option_sets(kind: str | AttentionSpec, items: list[str] | tuple[str, ...]) -> dict:
    """``--set model.attn_options.KEY=VALUE`` items as ``{KEY: value}``, each parsed and checked by
    the type of ``kind``'s option of that name (one-line errors name the item and what is allowed)."""
    spec = target_spec(kind)
    cls = spec.options
    opts = cls()
    given = []
    for item in items or ():
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise MheError(f"--set takes KEY=VALUE, got {item!r}")
        if not key.startswith(PREFIX) or key == PREFIX:
            names = ", ".join(f.name for f in dataclasses.fields(cls)) or "none"
            raise MheError(f"convert --set {key!r} is not allowed: a conversion keeps the source's model and takes "
                           f"only {PREFIX}KEY of the target kind {spec.name!r} (keys: {names})")
        path = key[len(PREFIX):].split(".")
        opts = set_path(opts, path, raw, key)
        given.append(path[0])
    return {name: getattr(opts, name) for name in given}


def target_options(kind: str | AttentionSpec, n_kv_heads: int = 0, options: dict | None = None):
    """The options dataclass the ``kind`` sublayers are built with: ``options`` (a dict, as
    :func:`parse_option_sets` gives) with ``n_kv_heads`` (gqa; 0: the kind's default)."""
    spec = attention_spec(kind)
    values = dict(options or {})
    if n_kv_heads:
        given = values.get("n_kv_heads", n_kv_heads)
        if given != n_kv_heads:
            raise MheError(f"--n-kv-heads {n_kv_heads} and --set {PREFIX}n_kv_heads={given} disagree; give one")
        values["n_kv_heads"] = n_kv_heads
    return spec.make_options(values)


def source_heads(path: str | Path) -> int | None:
    """The source's attention head count, read from its ``config.json`` alone (a run's ``model``,
    a Hugging Face ``num_attention_heads`` or GPT-2's ``n_head``; None where it says none): the
    conversion's options are checked against it before any weights load."""
    try:
        record = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the loader says what is wrong with the folder
    if not isinstance(record, dict):
        return None
    model = record.get("model") if isinstance(record.get("model"), dict) and "run" in record else record
    n = next((model[k] for k in ("n_heads", "num_attention_heads", "n_head") if k in model), None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


def check_request(source: str | Path, kind: str | AttentionSpec, n_kv_heads: int) -> None:
    """What ``mhe convert`` can refuse without torch or weights (issue 58): a source that does not
    exist, ``n_kv_heads`` for a kind other than gqa, or one that does not divide the source's heads
    (the same words as :func:`mhe.convert.model.check_conversion`, which checks it again)."""
    if not Path(source).exists():
        raise MheError(f"{source} does not exist: pass a run folder (with config.json) or a Hugging Face "
                       "checkpoint directory")
    spec = attention_spec(kind)
    if not spec.grouped and n_kv_heads:
        raise MheError(f"n_kv_heads={n_kv_heads} applies to gqa only, not to {spec.name!r}")
    heads = source_heads(source)
    if n_kv_heads < 0 or (n_kv_heads and heads and heads % n_kv_heads):
        raise MheError(f"n_kv_heads={n_kv_heads} must be a positive divisor of n_heads={heads} "
                       "(or 0: the default, n/4)")
