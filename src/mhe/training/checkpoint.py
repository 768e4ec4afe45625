"""Atomic checkpoints that load without unpickling anything.

A checkpoint is a sealed folder ``step-XXXXXXXX`` (see :mod:`mhe.training.atomic`)
holding ``model.safetensors`` and the trainer's state
(:class:`mhe.training.state.TrainerState`) split into safetensors for tensors and
JSON for the rest: ``optimizer.safetensors`` + ``optimizer.json``,
``rng.safetensors`` + ``rng.json``, ``scheduler.json`` and ``trainer.json``
(step, data position, best score, patience count, config hash). A folder
without a manifest, or whose files do not match it, is reported and skipped,
never loaded.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mhe.errors import MheError
from mhe.training.atomic import new_temp_folder, seal_and_place, verify
from mhe.training.atomic import write_json_atomic, write_text_atomic  # noqa: F401  (re-exported)
from mhe.training.weights import WEIGHTS, load_state_strict, read_sealed_weights, tensors_for_saving

PREFIX = "step-"
# the trainer state's parts that get files of their own; everything else goes to trainer.json
_OWN_FILES = ("optimizer", "scheduler", "rng")


def _split_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = {}, {"param_groups": state["param_groups"], "state": {}}
    for idx, slots in state["state"].items():
        meta["state"][str(idx)] = {}
        for key, val in slots.items():
            if torch.is_tensor(val):
                tensors[f"{idx}/{key}"] = val.detach().to("cpu").contiguous().clone()
            else:
                meta["state"][str(idx)][key] = val
    return tensors, meta


def _join_optimizer(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {int(i): dict(v) for i, v in meta["state"].items()}
    for name, t in tensors.items():
        idx, key = name.split("/", 1)
        state.setdefault(int(idx), {})[key] = t
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(root: str | Path, *, model: torch.nn.Module, state: dict, keep_last: int = 3) -> Path:
    """Write ``model`` and a trainer ``state`` (``TrainerState.state_dict()``) atomically as
    ``root/step-XXXXXXXX`` and keep the newest ``keep_last``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    step = int(state["step"])
    tmp = new_temp_folder(root, f"{PREFIX}{step:08d}")
    save_file(tensors_for_saving(model.state_dict()), str(tmp / WEIGHTS))
    opt_tensors, opt_meta = _split_optimizer(state["optimizer"])
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
    save_file(state["rng"]["tensors"], str(tmp / "rng.safetensors"))
    (tmp / "rng.json").write_text(json.dumps(state["rng"]["meta"]))
    (tmp / "scheduler.json").write_text(json.dumps(state["scheduler"]))
    (tmp / "trainer.json").write_text(json.dumps({k: v for k, v in state.items() if k not in _OWN_FILES}, indent=2))
    final = seal_and_place(tmp, root / f"{PREFIX}{step:08d}", step=step)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def latest_checkpoint(root: str | Path, *, report=print) -> Path | None:
    """The newest complete checkpoint; incomplete or corrupt ones are reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        report(f"skipping checkpoint {path}: {problem}")
    return None


def load_checkpoint(path: str | Path, *, model: torch.nn.Module,
                    map_location: str | torch.device = "cpu") -> dict:
    """Load the weights :func:`save_checkpoint` wrote into ``model`` (strictly, manifest
    checked) and return the trainer state for ``TrainerState.load_state_dict``."""
    path = Path(path)
    load_state_strict(model, read_sealed_weights(path, map_location=map_location), source=path / WEIGHTS)
    try:
        state = json.loads((path / "trainer.json").read_text())
        state["optimizer"] = _join_optimizer(load_file(str(path / "optimizer.safetensors")),
                                             json.loads((path / "optimizer.json").read_text()))
        state["scheduler"] = json.loads((path / "scheduler.json").read_text())
        state["rng"] = {"tensors": load_file(str(path / "rng.safetensors")),
                        "meta": json.loads((path / "rng.json").read_text())}
    except (ValueError, KeyError, TypeError) as e:  # sealed but written by something else
        raise MheError(f"checkpoint {path} cannot be loaded: {e}") from e
    return state
