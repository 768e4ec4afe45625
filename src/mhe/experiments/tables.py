"""Plain-text tables for the terminal: Markdown with right-aligned numbers."""

from __future__ import annotations

import sys


def print_table(headers: list[str], rows: list[list], *, file=None) -> None:
    """Print a Markdown table: the first column left-aligned, the others right-aligned, every
    column as wide as its widest cell."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    out = file or sys.stdout
    print("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |", file=out)
    print("|" + "|".join("-" * (w + 1) + ":" if i else "-" * (w + 2) for i, w in enumerate(widths)) + "|", file=out)
    for r in cells:
        print("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
              + " |", file=out)
