"""Typed settings: parse ``--set KEY=VALUE`` text by a dataclass field's type and check
every field of a configuration (type, finiteness, range, allowed values) in one place.

A field states its type in its annotation (``int``, ``float``, ``bool``, ``str``,
``Literal[...]``, ``X | None``, ``tuple[float, float]``, ``list[int]`` or a nested
dataclass) and its range in its metadata, written with :func:`setting`::

    lr: float = setting(1e-4, gt=0)

Every error is an :class:`~mhe.errors.MheError` of one line naming the key, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from functools import cache
from typing import Any, Literal, Union

from mhe.errors import MheError

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def setting(default: Any = dataclasses.MISSING, *, ge=None, gt=None, le=None, lt=None,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field whose numeric value must satisfy the given bounds."""
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    return dataclasses.field(default=default, default_factory=default_factory, metadata={"bounds": bounds})


@cache
def field_types(cls: type) -> dict[str, Any]:
    """Field name -> resolved annotation of a dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def describe(tp: Any) -> str:
    """What a type allows, in words, for error messages."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a finite number"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if _optional(tp) is not None:
        return f"{describe(_optional(tp))} or null"
    if _union(tp):
        return " or ".join(describe(a) for a in args)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list of {describe(args[0])} items"
        return f"a list of {len(args)} items ({', '.join(describe(a) for a in args)})"
    if origin is list:
        return f"a list of {describe(args[0])} items" if args else "a list"
    if dataclasses.is_dataclass(tp):
        return "a JSON object with keys " + ", ".join(f.name for f in dataclasses.fields(tp))
    return getattr(tp, "__name__", str(tp))


def _optional(tp: Any):
    """X for ``X | None``, else None."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1 and len(typing.get_args(tp)) == 2:
            return rest[0]
    return None


def _union(tp: Any) -> bool:
    """True for a union of several types (``bool | Literal["auto"]``) other than ``X | None``."""
    return typing.get_origin(tp) in (Union, types.UnionType) and _optional(tp) is None


def _first_fit(key: str, value: Any, tp: Any, convert) -> Any:
    """``convert(key, value, member)`` for the first member of the union ``tp`` it suits."""
    for member in typing.get_args(tp):
        try:
            return convert(key, value, member)
        except MheError:
            continue
    raise _bad(key, value, tp)


def _bad(key: str, value: Any, tp: Any) -> MheError:
    return MheError(f"{key}={value!r} is not allowed; {key} takes {describe(tp)}")


def parse_text(key: str, text: str, tp: Any) -> Any:
    """The value of ``--set key=text`` for a field of type ``tp`` (checked by :func:`coerce`)."""
    if tp is str or typing.get_origin(tp) is Literal:
        return coerce(key, text, tp)
    if _union(tp):
        return _first_fit(key, text, tp, parse_text)
    if tp is bool:
        low = text.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        raise _bad(key, text, tp)
    if tp in (int, float):
        try:
            value = float(text) if tp is float else json.loads(text)
        except ValueError as e:
            raise _bad(key, text, tp) from e
        return coerce(key, value, tp)
    inner = _optional(tp)
    if inner is not None and text.strip().lower() in ("null", "none", ""):
        return None
    if inner is not None:
        return parse_text(key, text, inner)
    try:
        value = json.loads(text)
    except ValueError as e:
        raise _bad(key, text, tp) from e
    return coerce(key, value, tp)


def coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (ints may stand for floats, lists for tuples), or a one-line error."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    inner = _optional(tp)
    if inner is not None:
        return None if value is None else coerce(key, value, inner)
    if _union(tp):
        return _first_fit(key, value, tp, coerce)
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(key, value, tp)
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(key, value, tp)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _bad(key, value, tp)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _bad(key, value, tp)
        return value
    if origin is Literal:
        if value not in args or type(value) is not type(args[0]):
            raise _bad(key, value, tp)
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _bad(key, value, tp)
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            if len(value) != len(args):
                raise _bad(key, value, tp)
            return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [v if item is Any else coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise _bad(key, value, tp)
        return build(tp, value, key)
    return value


def check_bounds(key: str, value: Any, bounds: dict) -> None:
    """Raise unless ``value`` lies within ``bounds`` (``ge``/``gt``/``le``/``lt``)."""
    if value is None or isinstance(value, bool) or not bounds:
        return
    values = value if isinstance(value, (list, tuple)) else [value]
    for v in values:
        ok = all({"ge": v >= b, "gt": v > b, "le": v <= b, "lt": v < b}[op] for op, b in bounds.items())
        if not ok:
            allowed = " and ".join(f"{_BOUNDS[op]} {b}" for op, b in bounds.items())
            raise MheError(f"{key}={value!r} is out of range; {key} must be {allowed}")


def check_fields(obj: Any, prefix: str) -> None:
    """Coerce and check every field of the dataclass ``obj`` in place (nested ones too)."""
    types_ = field_types(type(obj))
    for f in dataclasses.fields(obj):
        key = f"{prefix}.{f.name}"
        value = coerce(key, getattr(obj, f.name), types_[f.name])
        check_bounds(key, value, f.metadata.get("bounds", {}))
        if dataclasses.is_dataclass(value):
            check_fields(value, key)
        object.__setattr__(obj, f.name, value)  # frozen dataclasses too


def unknown_key(key: str, cls: type) -> MheError:
    """The error for a key ``cls`` lacks, listing the valid ones."""
    valid = ", ".join(f.name for f in dataclasses.fields(cls)) or "none"
    return MheError(f"unknown setting {key!r}; valid {key.rpartition('.')[0]} keys: {valid}")


def build(cls: type, values: dict, prefix: str):
    """An instance of ``cls`` from a dict (unknown keys named, values coerced and checked
    against their bounds before ``cls``'s own ``__post_init__`` sees them)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in values:
        if name not in fields:
            raise unknown_key(f"{prefix}.{name}", cls)
    types_ = field_types(cls)
    coerced = {k: coerce(f"{prefix}.{k}", v, types_[k]) for k, v in values.items()}
    for k, v in coerced.items():
        check_bounds(f"{prefix}.{k}", v, fields[k].metadata.get("bounds", {}))
    return cls(**coerced)


def nondefault(obj: Any) -> dict:
    """The fields of a dataclass instance that differ from their defaults."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            out[f.name] = value
            continue
        if value != default:
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def set_path(obj: Any, path: list[str], value: Any, key: str, *, text: bool = True) -> Any:
    """Set the dotted ``path`` under the dataclass ``obj`` to ``value`` (``--set`` text when
    ``text``, else an already parsed JSON value); returns ``obj`` (a new one if frozen).

    A field holding a dataclass takes a JSON object, which sets each of its keys.
    """
    name, fields = path[0], {f.name: f for f in dataclasses.fields(obj)}
    if name not in fields:
        raise unknown_key(key, type(obj))
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
        if len(path) > 1:
            new = set_path(current, path[1:], value, key, text=text)
        else:
            if text:
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise _bad(key, value, type(current)) from e
            if not isinstance(value, dict):
                raise _bad(key, value, type(current))
            new = current
            for k, v in value.items():
                new = set_path(new, [k], v, f"{key}.{k}", text=False)
    elif len(path) > 1:
        raise MheError(f"unknown setting {key!r}: {key.rsplit('.', len(path) - 1)[0]} has no sub-keys")
    else:
        tp = field_types(type(obj))[name]
        new = parse_text(key, value, tp) if text else coerce(key, value, tp)
        check_bounds(key, new, fields[name].metadata.get("bounds", {}))
    if getattr(type(obj), "__dataclass_params__").frozen:
        return dataclasses.replace(obj, **{name: new})
    setattr(obj, name, new)
    return obj


def typed_options(cls: type, value: Any, key: str, owner: str) -> Any:
    """``value`` (None, a dict, or another options dataclass) as an instance of ``cls``.

    ``owner`` names whose options they are in errors ("attention kind 'gqa'"). Options
    carried over from another class keep only what was changed from its defaults; a
    changed option ``cls`` lacks is an error.
    """
    if value is None:
        return cls()
    if isinstance(value, cls):
        check_fields(value, key)
        return value
    if dataclasses.is_dataclass(value):
        value = nondefault(value)
    if not isinstance(value, dict):
        raise MheError(f"{key}={value!r} is not allowed; {key} takes a JSON object of {owner} options")
    names = [f.name for f in dataclasses.fields(cls)]
    bad = [k for k in value if k not in names]
    if bad:
        raise MheError(f"unknown setting '{key}.{bad[0]}' for {owner}; valid {key} keys: {', '.join(names) or 'none'}")
    opts = build(cls, value, key)
    check_fields(opts, key)
    return opts
