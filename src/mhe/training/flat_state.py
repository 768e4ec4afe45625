"""Nested state (dicts, lists, tensors, numbers) as flat tensors plus a JSON skeleton, so a
trainer state saves as one safetensors file and one JSON file without pickling anything.

Each tensor is stored under its path of keys joined by ``/`` (``optimizer/state/0/exp_avg``)
and its place in the skeleton holds ``{"__tensor__": PATH}``; dicts whose keys are integers
(an optimiser's per-parameter state) are marked ``{"__int_keys__": {...}}`` so the keys come
back as integers. Tuples come back as lists; everything else must be a JSON value.
"""

from __future__ import annotations

import torch

TENSOR, INT_KEYS = "__tensor__", "__int_keys__"


def flatten(state: object) -> tuple[dict[str, torch.Tensor], object]:
    """(tensors keyed by path, JSON skeleton) of a nested ``state``."""
    tensors: dict[str, torch.Tensor] = {}
    return tensors, _flatten(state, "", tensors)


def _flatten(obj: object, path: str, tensors: dict) -> object:
    if torch.is_tensor(obj):
        key = path or "."
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {TENSOR: key}
    if isinstance(obj, dict):
        if obj and all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
            return {INT_KEYS: {str(k): _flatten(v, f"{path}/{k}".lstrip("/"), tensors) for k, v in obj.items()}}
        if not all(isinstance(k, str) for k in obj) or TENSOR in obj or INT_KEYS in obj:
            raise TypeError(f"state at {path or '(top)'}: keys must all be strings or all integers, got {list(obj)}")
        return {k: _flatten(v, f"{path}/{k}".lstrip("/"), tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, f"{path}/{i}".lstrip("/"), tensors) for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"state at {path or '(top)'}: cannot save a {type(obj).__name__}")


def unflatten(skeleton: object, tensors: dict[str, torch.Tensor]) -> object:
    """The nested state :func:`flatten` took apart (a missing tensor raises ``KeyError``)."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {TENSOR}:
            return tensors[skeleton[TENSOR]]
        if set(skeleton) == {INT_KEYS}:
            return {int(k): unflatten(v, tensors) for k, v in skeleton[INT_KEYS].items()}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton
