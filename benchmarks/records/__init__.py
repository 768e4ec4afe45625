"""The parts of ``results_tools.py``: the run-folder migration, the scaling overview and the recall
grid's records (when runs left the plateau, how long they took)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def emit(text: str, out: Path | None) -> int:
    """Print a record's markdown table and, with ``--out``, write it atomically too; exit status 0."""
    print(text)
    if out:
        from mhe.training.atomic import write_text_atomic

        write_text_atomic(out, text + "\n")
    return 0


def guarded(ap: argparse.ArgumentParser, work: Callable[[], int]) -> int:
    """Run a record's ``work``; a run file it cannot read (a missing key, a value of the wrong type,
    unreadable JSON, two layouts of one folder) or an ``--out`` it cannot write is a one-line error
    of ``ap`` (exit 2), not a traceback."""
    try:
        return work()
    except KeyError as e:
        ap.error(f"a run's file has no {e} (a run of an older layout, or a damaged one)")
    except (ValueError, TypeError, OSError) as e:  # MheError is a ValueError
        ap.error(str(e))
