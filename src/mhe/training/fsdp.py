"""Sharded data parallelism (FSDP2): each of N processes keeps 1/N of the weights, gradients and
AdamW moments, and gathers one block's weights just before it runs.

PyTorch's ``fully_shard`` (torch >= 2.6: ``torch.distributed.fsdp``; 2.5:
``torch.distributed._composable.fsdp``) is applied as torchtitan does: to every transformer
block, then to the root module (the embeddings, final norm and output layer, tied weights
included). On a GPU the gathered weights are bf16 and the gradients are reduced in float32
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``); the sharded weights the
optimiser updates stay float32. On a CPU (gloo) everything is float32.

What leaves the sharded state stays what a run folder holds without FSDP:

* :class:`FullCopy` is a copy of the model without weights of its own (on the meta device);
  while in use it holds the full weights, gathered from the shards, so evaluation, ``best/``,
  checkpoints and the final results see an ordinary module (the same float32 weights a single
  process would have), at 4 bytes per parameter on every process while it lasts;
* :func:`full_optimizer_state` makes the optimiser's ``state_dict()`` gather its sharded moments
  into full tensors (on the main process; the others keep shapes only) and its
  ``load_state_dict()`` shard full tensors back, so a checkpoint holds the optimiser state of a
  single process, index for index, and resumes on any number of processes.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from mhe.errors import MheError
from mhe.training.activation_checkpointing import transformer_blocks
from mhe.training.distributed import Dist

try:  # torch >= 2.6
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch 2.5
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
try:  # torch >= 2.5
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # pragma: no cover
    from torch.distributed._tensor import DTensor, distribute_tensor


def shard(model: nn.Module, dist: Dist, *, param_dtype: torch.dtype | None) -> list[nn.Module]:
    """Shard ``model`` in place over the ``dist.world`` processes: each transformer block its
    own unit, then the root; the parameters move to ``dist.device``. ``param_dtype``: the dtype
    of the gathered weights (None: the parameters' own). Returns the blocks."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise MheError(f"train.parallel=fsdp shards transformer blocks; {type(model).__name__} has none")
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    for i, block in enumerate(blocks):
        # the last block's weights are needed again as soon as the backward pass starts
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return blocks


def plain(t: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor (the gradient norm of sharded gradients) as an ordinary tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class FullCopy:
    """``model`` (not yet sharded) copied without its weights: the module tree, buffers (on
    ``device``) and hooks, each parameter a meta tensor (tied ones stay one)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        memo = {id(p): nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
                for p in model.parameters()}
        self.module = copy.deepcopy(model, memo)
        for m in self.module.modules():
            for key, buf in m._buffers.items():
                if buf is not None:
                    m._buffers[key] = buf.to(device)
        owners: dict[int, list[tuple[nn.Module, str]]] = {}
        for m in self.module.modules():
            for key, p in m._parameters.items():
                if p is not None:
                    owners.setdefault(id(p), []).append((m, key))
        self.slots = {name: owners[id(p)] for name, p in self.module.named_parameters()}

    @contextlib.contextmanager
    def filled(self, model: nn.Module):
        """The copy holding ``model``'s full weights (gathered from the shards on every process:
        a collective, so every process enters it at the same point), emptied again on exit."""
        with torch.no_grad():
            for name, p in model.named_parameters():
                self._place(name, nn.Parameter(plain(p.detach()), requires_grad=False))
        try:
            yield self.module
        finally:
            for name, owners in self.slots.items():
                p = owners[0][0]._parameters[owners[0][1]]
                self._place(name, nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False))

    def _place(self, name: str, param: nn.Parameter) -> None:
        for owner, key in self.slots[name]:  # tied weights: one parameter in every place
            owner._parameters[key] = param


def full_optimizer_state(optimizer: torch.optim.Optimizer, dist: Dist) -> None:
    """Make ``optimizer``'s state dicts full (see the module docstring). Installed after the
    vocabulary padding's hooks (:func:`~mhe.models.vocab_padding.pad_optimizer_state`): its
    rows are cut from the gathered tensors and added before they are sharded again."""

    def gather(opt, state: dict) -> dict:
        slots = {}
        for idx, values in state["state"].items():
            slots[idx] = {key: _gathered(v, keep=dist.main) for key, v in values.items()}
        return {**state, "state": slots}

    def scatter(opt, state: dict) -> dict:
        saved = [i for group in state["param_groups"] for i in group["params"]]
        params = dict(zip(saved, [p for group in opt.param_groups for p in group["params"]]))
        slots = {}
        for idx, values in state["state"].items():
            p = params.get(idx)
            slots[idx] = {key: _sharded_like(v, p) for key, v in values.items()}
        return {**state, "state": slots}

    optimizer.register_state_dict_post_hook(gather, prepend=True)  # before the padding is cut
    optimizer.register_load_state_dict_pre_hook(scatter)  # after the padding is added


def _gathered(v, *, keep: bool):
    if not isinstance(v, DTensor):
        return v
    full = v.full_tensor()  # every process takes part in the gather
    return full.cpu() if keep else torch.empty_like(full, device="meta")


def _sharded_like(v, p):
    if not isinstance(p, DTensor) or not torch.is_tensor(v) or v.dim() == 0:
        return v  # AdamW's step count: one number, the same on every process
    if tuple(v.shape) != tuple(p.shape):
        raise MheError(f"the checkpoint's optimiser state has shape {tuple(v.shape)} where the parameter "
                       f"has {tuple(p.shape)}")
    return distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
