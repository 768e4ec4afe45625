"""Checkpoint averaging and the last checkpoints of a run (the WMT-14 protocol, section 4.4).

The paper reports the BLEU "on the last five epochs": each of the last five
checkpoints is decoded with the final beam settings and the scores averaged.
Averaging the *weights* of the last checkpoints before decoding is the other common
protocol (Vaswani et al. 2017, section 6.1: the last 5 checkpoints of the base
model); :func:`average_state_dicts` implements it as a pure function.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from mhe.errors import MheError
from mhe.training.checkpoint import list_checkpoints, verify


def average_state_dicts(states: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The element-wise mean of model state dicts.

    Floating tensors are summed in float64 and cast back to their own dtype; other tensors
    (step counters, integer buffers) must be equal in every state and are copied.

    Args:
        states: one or more state dicts with the same keys and shapes.

    Returns:
        A new state dict (the inputs are not modified).
    """
    if not states:
        raise MheError("average_state_dicts needs at least one state dict, got none")
    keys = list(states[0])
    for i, s in enumerate(states[1:], 1):
        if set(s) != set(keys):
            diff = sorted(set(s) ^ set(keys))
            raise MheError(f"state dict {i} has other keys than state dict 0 (first difference: {diff[0]!r})")
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        ts = [s[k] for s in states]
        shape = ts[0].shape
        if any(t.shape != shape for t in ts):
            raise MheError(f"{k!r} has different shapes across the state dicts: {[tuple(t.shape) for t in ts]}")
        if ts[0].is_floating_point():
            total = torch.zeros(shape, dtype=torch.float64)
            for t in ts:
                total += t.detach().to("cpu", torch.float64)
            out[k] = (total / len(ts)).to(ts[0].dtype)
        else:
            if any(not torch.equal(t, ts[0]) for t in ts[1:]):
                raise MheError(f"{k!r} is not a floating tensor and differs across the state dicts")
            out[k] = ts[0].detach().clone()
    return out


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete, intact checkpoint folders under ``root``, oldest first."""
    return [p for p in list_checkpoints(root) if verify(p) is None]


def last_checkpoints(root: str | Path, n: int) -> list[Path]:
    """The newest ``n`` complete checkpoints, oldest first (fewer when fewer exist)."""
    if n <= 0:
        raise MheError(f"the number of checkpoints must be positive, got {n}")
    return complete_checkpoints(root)[-n:]


def checkpoint_step(checkpoint: str | Path) -> int:
    """The step a checkpoint folder (``step-00001234``) was saved at."""
    name = Path(checkpoint).name
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError) as e:
        raise MheError(f"{name!r} is not a checkpoint folder name (step-NNNNNNNN)") from e
