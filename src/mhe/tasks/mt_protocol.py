"""The WMT-14 reporting protocol (section 4.4): "we use one random seed and report the
average on the last five epochs".

Each of the last ``n`` checkpoints (one per epoch with ``checkpoint_every="epoch"``) is
decoded with the final beam settings and the BLEU scores are averaged. Optionally the
weights of those checkpoints are averaged first and the average decoded once
(:func:`mhe.training.averaging.average_state_dicts`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from mhe.errors import MheError
from mhe.training.averaging import average_state_dicts, checkpoint_step, model_weights
from mhe.training.weights import load_state_strict


def load_state(model: nn.Module, state: dict, source: str | Path) -> nn.Module:
    """Load a checkpoint's (or an average's) weights into ``model`` through the strict loader."""
    load_state_strict(model, state, source=source)
    return model


def last_checkpoint_scores(model: nn.Module, checkpoints: Sequence[Path],
                           score: Callable[[nn.Module], float]) -> dict:
    """Score every checkpoint with ``score`` (on a copy of ``model``): per checkpoint and the mean.

    Returns:
        ``{"scores": [...], "steps": [...], "mean": float}`` in checkpoint order.
    """
    if not checkpoints:
        raise MheError("no complete checkpoint to score")
    work = copy.deepcopy(model)
    scores = [float(score(load_state(work, model_weights(c), c).eval())) for c in checkpoints]
    return {"scores": scores, "steps": [checkpoint_step(c) for c in checkpoints],
            "mean": sum(scores) / len(scores)}


def averaged_checkpoint_score(model: nn.Module, checkpoints: Sequence[Path],
                              score: Callable[[nn.Module], float]) -> float:
    """``score`` of the model whose weights are the mean of the checkpoints' weights."""
    if not checkpoints:
        raise MheError("no complete checkpoint to average")
    work = copy.deepcopy(model)
    state = average_state_dicts([model_weights(c) for c in checkpoints])
    return float(score(load_state(work, state, f"the average of {len(checkpoints)} checkpoints").eval()))
