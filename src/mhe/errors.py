"""One exception type for bad input, so the command line can report it in one line."""

from __future__ import annotations

import functools
import inspect


class MheError(ValueError):
    """Invalid input: the message names the bad value and what is allowed."""


def one_of(what: str, value: object, allowed) -> MheError:
    """Build the error for a value outside a fixed set, listing the valid choices."""
    choices = ", ".join(str(a) for a in allowed)
    return MheError(f"unknown {what} {value!r}; valid: {choices}")


def require_positive(**values: object) -> None:
    """Raise if any named value is not a positive integer."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MheError(f"{name} must be a positive integer, got {value!r}")


def name_keys(keys, shown: int = 5) -> str:
    """Up to ``shown`` of ``keys`` and the count of the rest, for a one-line error."""
    keys = list(keys)
    rest = len(keys) - shown
    return ", ".join(keys[:shown]) + (f" and {rest} more" if rest > 0 else "")


def checked_keywords(fn):
    """``fn`` whose keyword mistakes (``generate(..., beams=4)``) are a one-line :class:`MheError`
    naming the unknown keyword and the ones ``fn`` takes, instead of Python's ``TypeError``."""
    params = inspect.signature(fn).parameters
    named = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and n != "self"]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bad = [k for k in kwargs if k not in params]
        if bad:
            name = fn.__qualname__.replace(".__init__", "")
            raise MheError(f"{name}() has no keyword {bad[0]!r}; valid: {', '.join(named)}")
        return fn(*args, **kwargs)

    return wrapper
