"""What a saved trainer state must agree with before a run continues from it: the checkpoint
folder it sits in, the run's configuration, the optimiser's parameters and itself.

Every check returns a description of the first disagreement, naming the file that holds the
part (``trainer.json`` or ``trainer.safetensors``), or None; the trainer then falls back to
the previous complete checkpoint, as it does for a bad checksum.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from mhe.training.config import MIGRATE

JSON, TENSORS = "trainer.json", "trainer.safetensors"
PARTS = ("step", "data", "optimizer", "scheduler", "rng", "config_hash")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def counters_problem(s: dict, *, step: int, config_hash: str, batches_per_epoch: int) -> str | None:
    """The step, data position, best step and patience count against the folder and the run."""
    missing = [k for k in PARTS if k not in s]
    if missing:
        return f"{JSON}: no {missing[0]!r}"
    if not _is_int(s["step"]) or s["step"] != step:
        return f"{JSON}: step {s['step']!r}, but the folder is step {step}"
    if s["config_hash"] != config_hash:
        return (f"{JSON}: configuration hash {s['config_hash']!r}, the run's is {config_hash!r} (a checkpoint of "
                f"an earlier release: {MIGRATE} RUN_FOLDER gives it today's hash)")
    best_step, bad = s.get("best_step"), s.get("bad_evals", 0)
    if best_step is not None and not (_is_int(best_step) and 0 <= best_step <= step):
        return f"{JSON}: best_step {best_step!r} is not a step in 0..{step}"
    if not (_is_int(bad) and bad >= 0):
        return f"{JSON}: bad_evals {bad!r} is not a count"
    data = s["data"]
    if not (isinstance(data, dict) and _is_int(data.get("epoch")) and _is_int(data.get("index"))
            and data["epoch"] >= 0 and 0 <= data["index"] <= batches_per_epoch):
        return f"{JSON}: data position {data!r} is not (epoch >= 0, index in 0..{batches_per_epoch})"
    return None


def saved_shapes(model: torch.nn.Module) -> dict[int, torch.Size]:
    """id(parameter) -> its shape as the model's state dict saves it (a padded vocabulary's real
    rows, :mod:`mhe.models.vocab_padding`): the shape its optimiser moments are saved with."""
    state = model.state_dict()
    return {id(p): state[name].shape for name, p in model.named_parameters() if name in state}


def optimizer_problem(saved: object, groups: list[list[torch.Tensor]],
                      shapes: dict[int, torch.Size] | None = None) -> str | None:
    """The optimiser state against the optimiser's parameter groups (``groups``: each group's
    parameters, as an optimiser holds them or :func:`~mhe.training.optim.param_groups` gives
    them before one is built) and parameter shapes (``shapes``: as :func:`saved_shapes` gives
    them; default the parameters' own)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or not isinstance(saved.get("state"), dict):
        return f"{JSON}: optimizer is not an optimiser state (param_groups and state)"
    saved_groups = saved["param_groups"]
    if [len(g.get("params", [])) for g in saved_groups] != [len(g) for g in groups]:
        return (f"{JSON}: optimizer has parameter groups of {[len(g.get('params', [])) for g in saved_groups]} "
                f"parameters, the model's optimiser {[len(g) for g in groups]}")
    params = [p for g in groups for p in g]
    position = {i: k for k, i in enumerate(i for g in saved_groups for i in g["params"])}  # saved id -> parameter
    for index, slots in saved["state"].items():
        if index not in position:
            return f"{JSON}: optimizer state for parameter {index!r}, which no parameter group holds"
        param = params[position[index]]
        want = (shapes or {}).get(id(param), param.shape)
        for name, value in (slots.items() if isinstance(slots, dict) else ()):
            if torch.is_tensor(value) and value.dim() > 0 and value.shape != want:
                return (f"{TENSORS}: optimizer/state/{index}/{name} has shape {tuple(value.shape)}, "
                        f"its parameter {tuple(want)}")
    return None


def scheduler_problem(saved: object, *, step: int, n_groups: int) -> str | None:
    """The learning-rate schedule's position against the step."""
    if not isinstance(saved, dict):
        return f"{JSON}: scheduler is not a scheduler state"
    if saved.get("last_epoch") != step:
        return f"{JSON}: the schedule is at step {saved.get('last_epoch')!r}, the checkpoint at {step}"
    if len(saved.get("base_lrs", [])) != n_groups:
        return f"{JSON}: the schedule has {len(saved.get('base_lrs', []))} learning rates, the optimiser {n_groups} groups"
    return None


def rng_problem(saved: object) -> str | None:
    """The random generators' states, tried on scratch generators (the process's stay untouched)."""
    try:
        tensors, meta = saved["tensors"], saved["meta"]
        torch.Generator().set_state(tensors["torch_cpu"])
    except (TypeError, KeyError, RuntimeError, ValueError) as e:
        return f"{TENSORS}: rng/tensors/torch_cpu is not a torch generator state ({str(e).splitlines()[0][:80]})"
    try:
        py = meta["python"]
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
    except (TypeError, KeyError, IndexError, ValueError) as e:
        return f"{JSON}: rng/meta/python is not a Python random state ({e})"
    try:
        n = meta["numpy"]
        np.random.RandomState().set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    except (TypeError, KeyError, IndexError, ValueError, OverflowError) as e:
        return f"{JSON}: rng/meta/numpy is not a NumPy random state ({e})"
    return None
