"""How the processes of a run share it: ``train.parallel`` resolved against the launch.

* one process: the model as it is (``train.parallel=ddp`` or ``fsdp`` is refused: there is
  nothing to copy to or shard over, and a setting that cannot apply is not left to look applied);
* ``ddp`` (the default on several processes): every process holds the whole model, its
  gradients and AdamW state (about 16 bytes per parameter before activations: 4 for the
  weights, 4 for the gradients, 8 for the two moments) and the gradients are averaged
  (:class:`~mhe.training.step.StepModule` wraps the model);
* ``fsdp``: every process holds 1/N of those and gathers each block's weights just in time
  (:mod:`mhe.training.fsdp`), for models whose training state does not fit on one card. The
  model is built, and a resumed checkpoint loaded into it and its optimiser, whole on the
  host, as without FSDP; :meth:`Parallel.prepare` then shards it onto the devices and moves
  the optimiser (and its loaded moments) onto the shards.

Activation checkpointing (:mod:`mhe.training.activation_checkpointing`) applies in every mode.
:meth:`Parallel.full` is the model every reader of weights sees (evaluation, ``best/``,
checkpoints, results): the model itself, or under FSDP its gathered :class:`~mhe.training.fsdp.FullCopy`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from mhe.errors import MheError
from mhe.models.vocab_padding import pad_optimizer_state
from mhe.training import fsdp
from mhe.training.activation_checkpointing import apply_activation_checkpointing
from mhe.training.config import TrainConfig
from mhe.training.distributed import Dist
from mhe.training.optim import build_optimizer
from mhe.training.state import TrainerState
from mhe.training.step import precision


@dataclass
class Parallel:
    """The resolved mode (``none``, ``ddp`` or ``fsdp``) of a run on ``dist``."""

    mode: str
    dist: Dist
    copy: fsdp.FullCopy | None = None

    @classmethod
    def resolve(cls, t: TrainConfig, dist: Dist) -> "Parallel":
        """``train.parallel`` for this launch; a one-line error where it cannot apply."""
        if t.parallel == "fsdp" and dist.world == 1:
            raise MheError("train.parallel=fsdp shards the model over several processes and this run has one; "
                           "launch it with torchrun --nproc_per_node N (N > 1) or leave train.parallel at auto")
        if t.parallel == "ddp" and dist.world == 1:
            raise MheError("train.parallel=ddp copies the model to several processes and this run has one; "
                           "launch it with torchrun --nproc_per_node N (N > 1) or leave train.parallel at auto")
        if dist.world == 1:
            return cls("none", dist)
        return cls("fsdp" if t.parallel == "fsdp" else "ddp", dist)

    @property
    def home(self) -> torch.device:
        """Where the model is built: on the host under FSDP (sharding moves 1/N of it to the
        device; the whole model never sits on one card), else on the run's device."""
        return torch.device("cpu") if self.mode == "fsdp" else self.dist.device

    def prepare(self, model: nn.Module, state: TrainerState, t: TrainConfig, log=print) -> None:
        """Activation checkpointing, then (FSDP) the weightless copy, the sharding and the
        optimiser rebuilt on the shards, carrying what ``state`` holds (a resumed checkpoint's
        moments and schedule, loaded into the whole model's optimiser first)."""
        if self.mode == "fsdp":
            self.copy = fsdp.FullCopy(model, self.dist.device)
        n = apply_activation_checkpointing(model, t.activation_checkpointing)
        if n and self.dist.main:
            log(f"activation checkpointing ({t.activation_checkpointing}): {n} block(s) recompute their activations")
        if self.mode == "fsdp":
            blocks = fsdp.shard(model, self.dist, param_dtype=precision(t.precision, self.dist.device))
            self._rebuild_optimizer(model, state, t)
            if self.dist.main:
                log(f"FSDP: {len(blocks)} blocks and the rest of the model sharded over {self.dist.world} processes")

    def _rebuild_optimizer(self, model: nn.Module, state: TrainerState, t: TrainConfig) -> None:
        """AdamW and its schedule on the sharded parameters (fused on CUDA), their state dicts
        gathered and sharded (:func:`~mhe.training.fsdp.full_optimizer_state`), loaded with the
        state of the optimiser built on the whole model (its moments: sharded here)."""
        opt, sched = build_optimizer(model, t)
        pad_optimizer_state(opt, model)
        fsdp.full_optimizer_state(opt, self.dist)
        if state.step > 0:  # resumed: carry the moments and the schedule (the new optimiser keeps its kernels)
            kernels = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in opt.param_groups]
            opt.load_state_dict(state.optimizer.state_dict())
            for group, own in zip(opt.param_groups, kernels):
                group.update(own)
            sched.load_state_dict(state.scheduler.state_dict())
        state.optimizer, state.scheduler = opt, sched

    @contextlib.contextmanager
    def full(self, model: nn.Module):
        """The model with its full weights, for reading them (every process must enter it)."""
        if self.copy is None:
            yield model
        else:
            with self.copy.filled(model) as whole:
                yield whole
