"""One exception type for bad input, so the command line can report it in one line."""

from __future__ import annotations


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
