"""Atomic checkpoints that load without unpickling anything.

A checkpoint is a sealed folder ``step-XXXXXXXX`` (see :mod:`mhe.training.atomic`) holding
``model.safetensors`` (the weights, as ``best/`` holds them) and the trainer's state
(:class:`mhe.training.state.TrainerState`: step, data position, best score, patience count,
configuration hash, optimiser, scheduler, random generators) flattened generically
(:mod:`mhe.training.flat_state`) into ``trainer.safetensors`` (every tensor, keyed by its
path, e.g. ``optimizer/state/0/exp_avg``) and ``trainer.json`` (everything else). A folder
without a manifest, or whose files do not match it, is reported and skipped, never loaded.

A checkpoint of weights alone (:func:`save_weights`: ``mhe convert``'s step 0, whose run has
not trained yet) is sealed the same way; a run resumed from it starts a fresh trainer state on
its weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from mhe.errors import MheError
from mhe.training.atomic import new_temp_folder, remove_folder, seal_and_place, verify
from mhe.training.atomic import write_json_atomic, write_text_atomic  # noqa: F401  (re-exported)
from mhe.training.config import MIGRATE
from mhe.training.flat_state import flatten, unflatten
from mhe.training.weights import WEIGHTS, load_state_strict, read_sealed_weights, state_problem, tensors_for_saving

PREFIX = "step-"
STATE_TENSORS, STATE_JSON = "trainer.safetensors", "trainer.json"
# the trainer state of the earlier layout, one file per part (benchmarks/results_tools.py migrate converts it)
OLD_STATE_FILES = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json", "scheduler.json")


def _write_state(tmp: Path, state: dict) -> None:
    tensors, skeleton = flatten(state)
    save_file(tensors, str(tmp / STATE_TENSORS))
    (tmp / STATE_JSON).write_text(json.dumps(skeleton, indent=1))


def rewrite_trainer_state(folder: Path, state: dict) -> None:
    """Replace a sealed checkpoint's trainer state by ``state`` in today's layout, keeping its
    weights, and seal it again (the migration of checkpoints in the earlier layout)."""
    tmp = new_temp_folder(folder.parent, folder.name)
    shutil.copyfile(folder / WEIGHTS, tmp / WEIGHTS)
    _write_state(tmp, state)
    seal_and_place(tmp, folder, step=int(state["step"]))


def save_checkpoint(root: str | Path, *, model: torch.nn.Module, state: dict, keep_last: int = 3) -> Path:
    """Write ``model`` and a trainer ``state`` (``TrainerState.state_dict()``) atomically as
    ``root/step-XXXXXXXX`` and keep the newest ``keep_last``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    tmp = new_temp_folder(root, f"{PREFIX}{step:08d}")
    save_file(tensors_for_saving(model.state_dict()), str(tmp / WEIGHTS))
    _write_state(tmp, state)
    final = seal_and_place(tmp, root / f"{PREFIX}{step:08d}", step=step)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        remove_folder(old)  # renamed aside first: a kill mid-deletion leaves no torn step-N folder
    return final


def save_weights(root: str | Path, *, model: torch.nn.Module, step: int = 0) -> Path:
    """Write ``model``'s weights alone atomically as ``root/step-XXXXXXXX`` (no trainer state:
    nothing has trained; see the module docstring)."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = new_temp_folder(root, f"{PREFIX}{step:08d}")
    save_file(tensors_for_saving(model.state_dict()), str(tmp / WEIGHTS))
    return seal_and_place(tmp, root / f"{PREFIX}{step:08d}", step=step)


def weights_only(path: Path) -> bool:
    """Whether the sealed checkpoint ``path`` holds weights and no trainer state (:func:`save_weights`)."""
    return not any((path / name).exists() for name in (STATE_TENSORS, STATE_JSON) + OLD_STATE_FILES)


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first (complete or not; not those set aside,
    ``step-N.rejected-REASON``)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and folder_step(p) is not None)


def folder_step(path: Path) -> int | None:
    """The step a checkpoint folder's name says (``step-00001234``), or None."""
    digits = path.name[len(PREFIX):]
    return int(digits) if path.name.startswith(PREFIX) and digits.isdigit() else None


def latest_checkpoint(root: str | Path, *, report=print) -> Path | None:
    """The newest complete checkpoint; incomplete or corrupt ones are reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        report(f"skipping checkpoint {path}: {problem}")
    return None


def _check_layout(path: Path) -> None:
    if not (path / STATE_TENSORS).is_file() and (path / OLD_STATE_FILES[0]).is_file():
        raise MheError(f"checkpoint {path} is in the earlier layout (its state in seven files); convert the run "
                       f"with: {MIGRATE} {path.parent.parent}")


def _read_state(path: Path) -> dict:
    """The trainer state of a verified checkpoint folder (one-line errors for unreadable files),
    its tensors on the CPU whatever device the run trains on: the random generators' states must
    be CPU byte tensors (on the GPU a resume refused every checkpoint and started from step 0),
    and the optimiser (or FSDP's sharding) moves each moment to its parameter as it loads."""
    _check_layout(path)
    try:
        tensors = load_file(str(path / STATE_TENSORS), device="cpu")
    except (SafetensorError, OSError) as e:
        raise MheError(f"{path / STATE_TENSORS} is not a readable safetensors file ({e})") from e
    try:
        state = unflatten(json.loads((path / STATE_JSON).read_text()), tensors)
    except (ValueError, KeyError, TypeError, OSError) as e:  # sealed but written by something else
        raise MheError(f"{path / STATE_JSON}: not a trainer state ({e})") from e
    if not isinstance(state, dict):
        raise MheError(f"{path / STATE_JSON}: not a trainer state (a JSON object)")
    return state


def read_trainer_state(path: str | Path) -> dict:
    """The trainer state of a sealed checkpoint folder (manifest checked), as saved, on the CPU."""
    path = Path(path)
    problem = verify(path)
    if problem is not None:
        raise MheError(f"checkpoint {path} cannot be loaded: {problem}")
    return _read_state(path)


def load_checkpoint(path: str | Path, *, model: torch.nn.Module,
                    map_location: str | torch.device = "cpu") -> dict:
    """Load the weights :func:`save_checkpoint` wrote into ``model`` (strictly, manifest
    checked; read onto ``map_location``) and return the trainer state for
    ``TrainerState.load_state_dict`` (on the CPU)."""
    path = Path(path)
    state = read_trainer_state(path)
    load_state_strict(model, read_sealed_weights(path, map_location=map_location), source=path / WEIGHTS)
    return state


def resumable_checkpoint(root: str | Path, *, model: torch.nn.Module, check, map_location="cpu",
                         report=print, rejected: list | None = None) -> tuple[Path, dict, dict | None] | None:
    """(folder, weights, trainer state) of the newest checkpoint whose every part agrees with
    ``model`` and, through ``check(state, step)`` (``TrainerState.problem``), with the run and
    itself; the state is None for a checkpoint of weights alone (:func:`save_weights`). A
    checkpoint that is incomplete, corrupt or disagrees is reported (the folder, the file and
    the disagreement) and the one before it tried; ``rejected`` collects each as (folder,
    reason) for :func:`set_aside`. One in the earlier layout is refused with the command that
    converts it. Nothing is loaded here."""
    for path in reversed(list_checkpoints(root)):
        _check_layout(path)
        found, reason, problem = _resume_candidate(path, model, check, map_location)
        if found is not None:
            return found
        report(f"skipping checkpoint {path}: {problem}")
        if rejected is not None:
            rejected.append((path, reason))
    return None


def _resume_candidate(path: Path, model, check, map_location) -> tuple[tuple | None, str, str]:
    """(found, reason, problem) of one checkpoint folder: ``found`` when it can be resumed from,
    else a one-word ``reason`` (incomplete, corrupt, unreadable, weights, state) and the problem."""
    problem = verify(path)
    if problem is not None:
        return None, "incomplete" if problem.startswith("no manifest") else "corrupt", problem
    try:
        weights = load_file(str(path / WEIGHTS), device=str(map_location))
        state = None if weights_only(path) else _read_state(path)
    except (MheError, SafetensorError, OSError) as e:
        return None, "unreadable", str(e)
    fit = state_problem(model, weights)
    if fit:
        return None, "weights", f"{WEIGHTS}: {fit}"
    problem = None if state is None else check(state, folder_step(path))
    if problem is not None:
        return None, "state", problem
    return (path, weights, state), "", ""


def set_aside(path: Path, reason: str) -> Path:
    """Rename a checkpoint a resume skipped to ``step-N.rejected-REASON`` (``-2``, ... when taken),
    so that training on from an earlier one never overwrites the evidence of what went wrong;
    returns the new folder. Such folders are no checkpoints any more (:func:`list_checkpoints`)."""
    target, n = path.with_name(f"{path.name}.rejected-{reason}"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.rejected-{reason}-{n}")
    path.rename(target)
    return target
