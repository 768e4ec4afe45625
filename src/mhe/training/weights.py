"""The one strict weight loader, and ``best/`` (the best evaluated weights) as a sealed folder.

Every load of model weights goes through :func:`load_state_strict`: best
weights, checkpoints, fine-tuning starts and ``mhe eval``/``translate``. Keys
may be missing or left over only when the caller names them (a new task head,
a pre-training head that fine-tuning drops); a shape that differs is refused.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mhe.errors import MheError, name_keys
from mhe.training.atomic import new_temp_folder, seal_and_place, verify

WEIGHTS = "model.safetensors"
BEST = "best"


def tensors_for_saving(state: dict) -> dict[str, torch.Tensor]:
    """CPU, contiguous copies (tied weights share storage, which safetensors refuses to save twice)."""
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


def state_problem(model: torch.nn.Module, state: dict[str, torch.Tensor], *, allow_missing: Collection[str] = (),
                  allow_unexpected: Collection[str] = ()) -> str | None:
    """How ``state`` disagrees with ``model`` (a weight missing or left over beyond those
    allowed, a shape that differs), or None when it fits."""
    own = model.state_dict()
    missing = [k for k in own if k not in state and k not in allow_missing]
    if missing:
        return f"lacks {len(missing)} weight(s) the model needs: {name_keys(missing)}"
    unexpected = [k for k in state if k not in own and k not in allow_unexpected]
    if unexpected:
        return f"holds {len(unexpected)} weight(s) the model does not have: {name_keys(unexpected)}"
    for k, v in state.items():
        if k in own and own[k].shape != v.shape:
            return f"weight {k!r} has shape {tuple(v.shape)}, the model needs {tuple(own[k].shape)}"
    return None


def load_state_strict(model: torch.nn.Module, state: dict[str, torch.Tensor], *, source: str | Path,
                      allow_missing: Collection[str] = (), allow_unexpected: Collection[str] = ()) -> None:
    """Copy ``state`` into ``model``: every model key must be in ``state`` unless listed in
    ``allow_missing``, every ``state`` key must be in the model unless listed in
    ``allow_unexpected``, and shapes must agree (:func:`state_problem`).

    Raises:
        MheError: one line naming ``source``, the first offending key and (for shapes) both shapes.
    """
    problem = state_problem(model, state, allow_missing=allow_missing, allow_unexpected=allow_unexpected)
    if problem is not None:
        raise MheError(f"{source}: {problem}")
    own = model.state_dict()
    # the allowed-missing keys keep the model's own values; strict: nothing else slips through
    model.load_state_dict({**own, **{k: v for k, v in state.items() if k in own}})


def read_sealed_weights(folder: str | Path, *, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """``folder/model.safetensors`` after checking the folder's manifest."""
    folder = Path(folder)
    problem = verify(folder)
    if problem is not None:
        raise MheError(f"{folder} cannot be loaded: {problem}")
    try:
        return load_file(str(folder / WEIGHTS), device=str(map_location))
    except (SafetensorError, OSError) as e:
        raise MheError(f"{folder / WEIGHTS} is not a readable safetensors file ({e})") from e


def load_weights(folder: str | Path, model: torch.nn.Module, *, allow_missing: Collection[str] = (),
                 allow_unexpected: Collection[str] = (), map_location: str | torch.device = "cpu") -> None:
    """Load the weights of a sealed folder (a checkpoint or ``best/``) strictly into ``model``."""
    state = read_sealed_weights(folder, map_location=map_location)
    load_state_strict(model, state, source=Path(folder) / WEIGHTS, allow_missing=allow_missing,
                      allow_unexpected=allow_unexpected)


def save_best(out: Path, model: torch.nn.Module, step: int, score: float) -> Path:
    """Seal the current weights as ``out/best`` with ``best.json`` (step, score)."""
    tmp = new_temp_folder(out, BEST)
    save_file(tensors_for_saving(model.state_dict()), str(tmp / WEIGHTS))
    (tmp / "best.json").write_text(json.dumps({"step": step, "score": score}))
    return seal_and_place(tmp, out / BEST, step=step)


def has_best(out: Path) -> bool:
    return (out / BEST / WEIGHTS).exists()


def load_best(out: Path, model: torch.nn.Module) -> None:
    """Put the best evaluated weights back into ``model`` (manifest checked, strict)."""
    load_weights(out / BEST, model, map_location=next(model.parameters()).device)
