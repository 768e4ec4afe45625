"""Compiled code: whether a call is being traced (:func:`tracing`), and running a
``torch.compile``-d callable with an eager fallback, for training and decoding alike.

``torch.compile`` fails on its first call, not when it is applied: dynamo cannot trace an
operator, inductor cannot lower one, or the machine has no working compiler. A run should not
stop for that, since the eager module computes the same function; it goes on eagerly after a
one-line note naming the failure. An :class:`~mhe.errors.MheError` is the caller's own (a bad
setting) and is raised as it is. The training step (:mod:`mhe.training.step`) and the captured
decode step (:mod:`mhe.generation.step`) both run their first compiled call through
:func:`run_or_fall_back`; what falling back means (swap in the eager module, clear partial
gradients, refuse under FSDP) is theirs.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch

from mhe.errors import MheError

T = TypeVar("T")


def tracing() -> bool:
    """True inside torch.compile or a CUDA graph capture, where reading the device is not allowed
    (the caches' and masks' host-side checks are skipped there)."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def run_or_fall_back(compiled: Callable[[], T], fall_back: Callable[[Exception, str], T]) -> T:
    """``compiled()``; if it raises anything but an :class:`~mhe.errors.MheError` (dynamo, inductor
    or a missing compiler), ``fall_back(error, summary)`` with :func:`summary`'s one line, whose
    result is returned instead (it may run the eager callable, or raise)."""
    try:
        return compiled()
    except MheError:
        raise
    except Exception as e:  # noqa: BLE001  dynamo, inductor or a missing compiler
        return fall_back(e, summary(e))


def summary(error: Exception) -> str:
    """``Type: first line`` of ``error``, at most 160 characters of its message, for a one-line note."""
    first = (str(error).strip().splitlines() or [""])[0][:160]
    return f"{type(error).__name__}: {first}"
