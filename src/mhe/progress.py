"""Progress on standard error for the phases that can take more than a few seconds (final
evaluation, perplexity windows, decoding for BLEU, SQuAD post-processing, tokenizer training,
data preparation): a tqdm bar with its ETA, or a one-line message where the work cannot be
counted. Each caller passes ``enabled`` (a run's ``train.progress``); when it is false nothing
is written, so standard output and logs stay clean for scripts and sweeps. Under ``torchrun``
only the main process (``RANK`` 0) draws. A bar is drawn only on a terminal: where standard
error is a file or a pipe the same progress comes as whole lines (:class:`Lines`: one a minute
and one at the end), never as carriage-return fragments in a log.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable, Iterator

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


class Lines:
    """A bar's progress as whole lines on standard error, for where it is not a terminal: one
    when ``every`` seconds have passed since the last, and one at the end (:meth:`close`). The
    calls of a tqdm bar that mhe makes: ``update``, ``set_postfix``, ``format_dict['rate']``,
    ``close``, use as a context manager."""

    def __init__(self, total: int, *, desc: str, unit: str, initial: int = 0, every: float = 60.0) -> None:
        self.n, self.initial, self.total, self.desc, self.unit, self.every = initial, initial, total, desc, unit, every
        self.start = self.last = time.monotonic()
        self.postfix, self.closed = "", False

    @property
    def format_dict(self) -> dict:
        elapsed = time.monotonic() - self.start
        return {"n": self.n, "total": self.total, "elapsed": elapsed,
                "rate": (self.n - self.initial) / elapsed if elapsed > 0 else None}

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.monotonic() - self.last >= self.every:
            self._line()

    def set_postfix(self, refresh: bool = True, **values) -> None:
        self.postfix = ", ".join(f"{k} {v}" for k, v in values.items())

    def _line(self) -> None:
        self.last = time.monotonic()
        print(f"{self.desc}: {self.n:,}/{self.total:,} {self.unit}s in {self.last - self.start:.1f} s"
              + (f" ({self.postfix})" if self.postfix else ""), file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def __enter__(self) -> "Lines":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def counter(total: int, *, desc: str, unit: str, initial: int = 0):
    """A tqdm bar on standard error where it is a terminal, else :class:`Lines`."""
    if not sys.stderr.isatty():
        return Lines(total, desc=desc, unit=unit, initial=initial)
    return tqdm(total=total, initial=initial, desc=desc or None, unit=unit, file=sys.stderr, dynamic_ncols=True,
                mininterval=1.0, leave=False)


def _counted(items: Iterable, shown: Lines) -> Iterator:
    with shown:
        for item in items:
            yield item
            shown.update(1)


def quiet_library_bars() -> None:
    """Off a terminal, transformers' own bars (loading and writing weights) off as well: set
    before huggingface_hub is imported, or through transformers' switch once it is."""
    if sys.stderr.isatty():
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    logging = sys.modules.get("transformers.utils.logging")
    if logging is not None:
        logging.disable_progress_bar()


def _shown(enabled: bool) -> bool:
    return enabled and os.environ.get("RANK", "0") == "0"


def bar(total: int, *, desc: str, unit: str, enabled: bool):
    """A bar of ``total`` ``unit`` on standard error (:func:`counter`; ``update(n)`` as work is
    done; use it as a context manager), or a silent stand-in when ``enabled`` is false."""
    if not _shown(enabled):
        return _Silent()
    return counter(total, desc=desc, unit=unit)


def each(items: Iterable, *, total: int, desc: str, unit: str, enabled: bool) -> Iterable:
    """``items`` themselves, counted on a bar while ``enabled``."""
    if not _shown(enabled):
        return items
    if not sys.stderr.isatty():
        return _counted(items, Lines(total, desc=desc, unit=unit))
    return tqdm(items, total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, mininterval=1.0,
                leave=False)


def note(message: str, *, enabled: bool) -> None:
    """One line on standard error before a phase that cannot be counted (tokenizer training)."""
    if _shown(enabled):
        print(message, file=sys.stderr, flush=True)
