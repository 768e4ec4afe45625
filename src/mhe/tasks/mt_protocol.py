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
from mhe.training.averaging import average_state_dicts, checkpoint_step
from mhe.training.weights import load_state_strict, load_weights, read_sealed_weights


def last_checkpoint_scores(model: nn.Module, checkpoints: Sequence[Path],
                           score: Callable[[nn.Module], float]) -> dict:
    """Score every checkpoint with ``score`` (on a copy of ``model``): per checkpoint and the mean.

    Returns:
        ``{"scores": [...], "steps": [...], "mean": float}`` in checkpoint order.
    """
    if not checkpoints:
        raise MheError("no complete checkpoint to score")
    work = copy.deepcopy(model)
    scores = []
    for c in checkpoints:
        load_weights(c, work)
        scores.append(float(score(work.eval())))
    return {"scores": scores, "steps": [checkpoint_step(c) for c in checkpoints],
            "mean": sum(scores) / len(scores)}


def averaged_checkpoint_score(model: nn.Module, checkpoints: Sequence[Path],
                              score: Callable[[nn.Module], float]) -> float:
    """``score`` of the model whose weights are the mean of the checkpoints' weights."""
    if not checkpoints:
        raise MheError("no complete checkpoint to average")
    work = copy.deepcopy(model)
    state = average_state_dicts([read_sealed_weights(c) for c in checkpoints])
    load_state_strict(work, state, source=f"the average of {len(checkpoints)} checkpoints")
    return float(score(work.eval()))
