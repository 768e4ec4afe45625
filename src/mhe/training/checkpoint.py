"""Atomic checkpoints that load without unpickling anything.

A checkpoint is a folder ``step-XXXXXXXX`` holding ``model.safetensors``,
``optimizer.safetensors`` + ``optimizer.json``, ``rng.safetensors`` +
``rng.json``, ``scheduler.json`` and ``trainer.json`` (step, data position,
config hash, ...). It is written to a temporary folder, every file fsynced,
``manifest.json`` (sha256 of every file) written last, and the folder renamed
into place. A folder without a manifest, or whose files do not match it, is
reported and skipped, never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mhe.errors import MheError

PREFIX = "step-"


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: str | Path, obj) -> None:
    """Write JSON through a temporary file, fsync and rename: readers never see half a file."""
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write text through a temporary file, fsync and rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)


def _tensors(state: dict) -> dict[str, torch.Tensor]:
    # clone: tied weights share storage, which safetensors refuses to save twice
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


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


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


def save_checkpoint(root: str | Path, step: int, *, model: torch.nn.Module, optimizer, scheduler,
                    trainer_state: dict, keep_last: int = 3) -> Path:
    """Write a complete checkpoint atomically and keep the newest ``keep_last``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(_tensors(model.state_dict()), str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _split_optimizer(optimizer.state_dict())
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    (tmp / "optimizer.json").write_text(json.dumps(opt_meta))
    rng_tensors, rng_meta = rng_state()
    save_file(rng_tensors, str(tmp / "rng.safetensors"))
    (tmp / "rng.json").write_text(json.dumps(rng_meta))
    (tmp / "scheduler.json").write_text(json.dumps(scheduler.state_dict() if scheduler is not None else {}))
    (tmp / "trainer.json").write_text(json.dumps({**trainer_state, "step": step}, indent=2))
    files = sorted(p.name for p in tmp.iterdir())
    for name in files:
        _fsync_file(tmp / name)
    manifest = {"step": step, "files": {name: _sha256(tmp / name) for name in files}}
    write_json_atomic(tmp / "manifest.json", manifest)
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync_dir(root)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint folders under ``root``, oldest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX))


def verify(path: Path) -> str | None:
    """Why ``path`` cannot be loaded, or None when it is complete and intact."""
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "no manifest (incomplete write)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError):
        return "unreadable manifest"
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            return f"missing {name}"
        if _sha256(f) != digest:
            return f"{name} does not match its checksum"
    return None


def latest_checkpoint(root: str | Path, *, report=print) -> Path | None:
    """The newest complete checkpoint; incomplete or corrupt ones are reported and skipped."""
    for path in reversed(list_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        report(f"skipping checkpoint {path}: {problem}")
    return None


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer=None, scheduler=None,
                    restore_rng: bool = True, map_location: str | torch.device = "cpu") -> dict:
    """Load what :func:`save_checkpoint` wrote; returns the trainer state."""
    path = Path(path)
    problem = verify(path)
    if problem is not None:
        raise MheError(f"checkpoint {path} cannot be loaded: {problem}")
    state = load_file(str(path / "model.safetensors"), device=str(map_location))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied_ok = all(k.endswith(("decoder.weight", "lm_head.weight")) for k in missing)
    if unexpected or not tied_ok:
        raise MheError(f"checkpoint {path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    if optimizer is not None:
        meta = json.loads((path / "optimizer.json").read_text())
        optimizer.load_state_dict(_join_optimizer(load_file(str(path / "optimizer.safetensors")), meta))
    if scheduler is not None:
        scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))
    if restore_rng:
        set_rng_state(load_file(str(path / "rng.safetensors")), json.loads((path / "rng.json").read_text()))
    return json.loads((path / "trainer.json").read_text())


def load_weights(path: str | Path, model: torch.nn.Module) -> None:
    """Only the model weights (for evaluation and fine-tuning)."""
    load_checkpoint(path, model=model, restore_rng=False)
