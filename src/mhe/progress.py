"""Progress on standard error for the phases that can take more than a few seconds (final
evaluation, perplexity windows, decoding for BLEU, SQuAD post-processing, tokenizer training,
data preparation): a tqdm bar with its ETA, or a one-line message where the work cannot be
counted. Each caller passes ``enabled`` (a run's ``train.progress``); when it is false nothing
is written, so standard output and logs stay clean for scripts and sweeps. Under ``torchrun``
only the main process (``RANK`` 0) draws.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable

from tqdm import tqdm


class _Silent:
    """What :func:`bar` returns when progress is off: the same calls, no output."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "_Silent":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _shown(enabled: bool) -> bool:
    return enabled and os.environ.get("RANK", "0") == "0"


def bar(total: int, *, desc: str, unit: str, enabled: bool):
    """A tqdm bar of ``total`` ``unit`` on standard error (``update(n)`` as work is done; use it
    as a context manager), or a silent stand-in when ``enabled`` is false."""
    if not _shown(enabled):
        return _Silent()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=1.0,
                leave=False)


def each(items: Iterable, *, total: int, desc: str, unit: str, enabled: bool) -> Iterable:
    """``items`` themselves, counted on a bar while ``enabled``."""
    if not _shown(enabled):
        return items
    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=1.0,
                leave=False)


def note(message: str, *, enabled: bool) -> None:
    """One line on standard error before a phase that cannot be counted (tokenizer training)."""
    if _shown(enabled):
        print(message, file=sys.stderr, flush=True)
