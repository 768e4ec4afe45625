"""The parts of ``results_tools.py``: the run-folder migration, the scaling overview and the recall
grid's records (when runs left the plateau, how long they took)."""

from __future__ import annotations

from pathlib import Path


def emit(text: str, out: Path | None) -> int:
    """Print a record's markdown table and, with ``--out``, write it atomically too; exit status 0."""
    print(text)
    if out:
        from mhe.training.atomic import write_text_atomic

        write_text_atomic(out, text + "\n")
    return 0
