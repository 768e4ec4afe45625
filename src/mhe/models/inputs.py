"""Checks of what a model's ``forward`` is given: token ids, masks and labels.

Misuse (float ids, a mask of the wrong shape, an id outside the vocabulary) raises
:class:`MheError` naming the argument, instead of an error from deep inside torch.
The checks read only shapes and dtypes, so they never wait for a GPU; the id-range
check reads values only of CPU tensors outside ``torch.compile`` (on a GPU an
out-of-range id still fails inside the embedding lookup).
"""

from __future__ import annotations

import torch

from mhe.errors import MheError

_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise MheError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _values_readable(t: torch.Tensor) -> bool:
    """True where reading values costs no device sync and no graph break."""
    return t.device.type == "cpu" and t.numel() > 0 and not torch.compiler.is_compiling()


def check_ids(name: str, ids, vocab_size: int) -> torch.Tensor:
    """``ids`` is an integer ``[B, T]`` tensor of ids in ``0 .. vocab_size - 1``."""
    ids = _tensor(name, ids)
    if ids.dim() != 2:
        raise MheError(f"{name} must have shape [B, T], got {tuple(ids.shape)}")
    if ids.dtype not in _INTEGER:
        raise MheError(f"{name} must hold integer token ids (torch.long), got {ids.dtype}")
    if _values_readable(ids):
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise MheError(f"{name} holds id {bad}, outside the vocabulary 0..{vocab_size - 1}")
    return ids


def check_mask(name: str, mask, batch: int, length: int | None = None) -> None:
    """``mask`` is ``None`` or a boolean / 0-1 integer ``[B, S]`` tensor (True = real token);
    ``length`` S is checked where it must equal the input's length."""
    if mask is None:
        return
    mask = _tensor(name, mask)
    if mask.dtype != torch.bool and mask.dtype not in _INTEGER:
        raise MheError(f"{name} must be boolean or 0/1 integers (True = real token), got {mask.dtype}")
    if mask.dim() != 2 or mask.shape[0] != batch or (length is not None and mask.shape[1] != length):
        want = f"[B={batch}, S={length}]" if length is not None else f"[B={batch}, S]"
        raise MheError(f"{name} must have shape {want}, got {tuple(mask.shape)}")


def check_labels(name: str, labels, shape: torch.Size) -> None:
    """Token labels: ``None`` or an integer tensor of the inputs' shape (-100 = ignored)."""
    if labels is None:
        return
    labels = _tensor(name, labels)
    if labels.dtype not in _INTEGER:
        raise MheError(f"{name} must hold integer token ids (torch.long), got {labels.dtype}")
    if labels.shape != shape:
        raise MheError(f"{name} must have the inputs' shape {tuple(shape)}, got {tuple(labels.shape)}")
