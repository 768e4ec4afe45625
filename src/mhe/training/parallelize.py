"""How a run's model is made ready for its steps: ``train.parallel`` resolved against the launch,
then activation checkpointing, ``torch.compile`` and FSDP or DDP, in that order (torchtitan's
``parallelize_llama`` applies them in the same order), then the optimiser, built once on the
parameters the steps update. ``train.parallel`` is read here and nowhere else.

The modes (:func:`resolve_mode`):

* ``none`` (one process): the model as it is (``train.parallel=ddp`` or ``fsdp`` is refused:
  there is nothing to copy to or shard over, and a setting that cannot apply is not left to
  look applied);
* ``ddp`` (the default on several processes): every process holds the whole model, its
  gradients and AdamW state (about 16 bytes per parameter before activations: 4 for the
  weights, 4 for the gradients, 8 for the two moments) and the gradients are averaged;
* ``fsdp``: every process holds 1/N of those and gathers each block's weights just in time
  (:mod:`mhe.training.fsdp`), for models whose training state does not fit on one card. The
  model is built, and a resumed checkpoint's weights loaded into it, whole on the host
  (:func:`home`); :func:`parallelize` shards it onto the devices, and the optimiser built on the
  shards loads a resumed checkpoint's moments by sharding them.

The wrapping (:func:`parallelize`):

1. activation checkpointing (:mod:`mhe.training.activation_checkpointing`), in every mode;
2. compilation where :func:`~mhe.training.config.compile_wanted` says so: the whole model, or
   under FSDP each transformer block's forward on its own, as torchtitan does, so that it runs
   between the hooks that gather and free the block's weights. Where batches have one shape
   (pre-training) the compiled step is also replayed as CUDA graphs (:func:`cuda_graphs_wanted`):
   the host queues a replay instead of each of the step's kernels, which is what bounds a
   compiled step at small batches or many layers;
3. FSDP (:func:`~mhe.training.fsdp.shard`) or DDP (:func:`data_parallel`). Under DDP the compiled
   model is wrapped (compiled first) and compiled whole, without dynamo's DDP optimiser:
   splitting the graph at the gradient buckets would let each bucket's all-reduce overlap the
   backward pass, but the step is bound by the host's time to queue its kernels, and the split
   graph (and dynamo's breaks in DDP's own forward) cost more host time than the overlap saves
   (docs/benchmarks.md section 7: 55 ms against 39 ms per step for gpt2-base at 16 rows per GPU
   on two H100s); the buckets are reduced after the backward pass, about 2 ms on NVLink for
   gpt2-base's float32 gradients (``train.grad_reduce=bf16`` sends them as bf16, half the bytes).

The result, :class:`Parallelized`, holds the :class:`~mhe.training.step.StepModule` the steps
call, builds the optimiser (:meth:`Parallelized.optimizer`) and gives every reader of weights
(evaluation, ``best/``, checkpoints, results) the model with its full weights
(:meth:`Parallelized.full`): the model itself, or under FSDP its gathered
:class:`~mhe.training.fsdp.FullCopy`, taken before any wrapping.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from mhe.errors import MheError
from mhe.models.vocab_padding import pad_optimizer_state
from mhe.training import fsdp
from mhe.training.activation_checkpointing import apply_activation_checkpointing, transformer_blocks
from mhe.training.config import TrainConfig, compile_wanted
from mhe.training.distributed import Dist
from mhe.training.optim import build_optimizer
from mhe.training.step import StepModule, precision

MODES = ("none", "ddp", "fsdp")


def resolve_mode(t: TrainConfig, dist: Dist) -> str:
    """``train.parallel`` for this launch (one of :data:`MODES`); a one-line error where it
    cannot apply."""
    if t.parallel == "fsdp" and dist.world == 1:
        raise MheError("train.parallel=fsdp shards the model over several processes and this run has one; "
                       "launch it with torchrun --nproc_per_node N (N > 1) or leave train.parallel at auto")
    if t.parallel == "ddp" and dist.world == 1:
        raise MheError("train.parallel=ddp copies the model to several processes and this run has one; "
                       "launch it with torchrun --nproc_per_node N (N > 1) or leave train.parallel at auto")
    if dist.world == 1:
        return "none"
    return "fsdp" if t.parallel == "fsdp" else "ddp"


def home(t: TrainConfig, dist: Dist) -> torch.device:
    """Where the model is built: on the host under FSDP (sharding moves 1/N of it to the device;
    the whole model never sits on one card), else on the run's device."""
    return torch.device("cpu") if resolve_mode(t, dist) == "fsdp" else dist.device


def cuda_graphs_wanted(t: TrainConfig, device: torch.device, *, static_shapes: bool, mode: str = "ddp") -> bool:
    """Whether the compiled step is replayed as CUDA graphs (``torch.compile(mode="reduce-overhead")``):
    ``train.cuda_graphs`` true, or ``auto`` for a task whose batches all have one shape (causal and
    masked LM pre-training; a graph is captured per shape, so variable-length batches would capture
    one per length). Only for a compiled model on CUDA, not under FSDP, whose hooks gather and free
    the shards between the blocks, and not with ``train.grad_accum`` > 1: the first micro-batch's
    gradients stay in the graph's output memory, which the next replay overwrites (PyTorch issue
    169545; ``validate`` refuses ``cuda_graphs=true`` with it). The replay queues a step's ~900 kernels at once: the
    gpt2-base step at 16 rows on an H100 went from 29.0 ms of host time (host-bound) to 9.3 ms,
    its GPU time unchanged (docs/benchmarks.md section 7)."""
    if not compile_wanted(t, device) or device.type != "cuda" or mode == "fsdp" or t.grad_accum > 1:
        return False
    return t.cuda_graphs is True or (t.cuda_graphs == "auto" and static_shapes)


@dataclass
class Parallelized:
    """A model made ready by :func:`parallelize`: ``model`` holds the parameters the optimiser
    updates (under FSDP, the shards), ``step`` is what the training steps call."""

    mode: str
    dist: Dist
    model: nn.Module
    step: StepModule
    copy: fsdp.FullCopy | None = None

    def optimizer(self, t: TrainConfig):
        """AdamW and its schedule (:func:`~mhe.training.optim.build_optimizer`: fused on CUDA) on
        the parameters the steps update; its state dicts hold the real vocabulary rows and, under
        FSDP, full tensors (:func:`~mhe.training.fsdp.full_optimizer_state`), so a checkpoint holds
        a single process's optimiser state and a resumed one loads into it, sharded as it loads."""
        opt, sched = build_optimizer(self.model, t)
        pad_optimizer_state(opt, self.model)
        if self.mode == "fsdp":
            fsdp.full_optimizer_state(opt, self.dist)
        return opt, sched

    @contextlib.contextmanager
    def full(self):
        """The model with its full weights, for reading them (every process must enter it)."""
        if self.copy is None:
            yield self.model
        else:
            with self.copy.filled(self.model) as whole:
                yield whole


def parallelize(model: nn.Module, t: TrainConfig, dist: Dist, *, static_shapes: bool,
                note: Callable[[str], None]) -> Parallelized:
    """Activation checkpointing, compilation and FSDP or DDP applied to ``model`` in place, in that
    order (see the module docstring); ``static_shapes``: the task's batches all have one shape.
    ``note`` receives one line per choice worth reporting (what is checkpointed, what is sharded,
    a setting that cannot apply here)."""
    mode = resolve_mode(t, dist)
    copy = fsdp.FullCopy(model, dist.device) if mode == "fsdp" else None  # a deep copy of the plain module
    n = apply_activation_checkpointing(model, t.activation_checkpointing)
    if n:
        note(f"activation checkpointing ({t.activation_checkpointing}): {n} block(s) recompute their activations")
    compiled = compile_wanted(t, dist.device)
    graphs = cuda_graphs_wanted(t, dist.device, static_shapes=static_shapes, mode=mode)
    if t.cuda_graphs is True and not graphs:
        note("train.cuda_graphs=true has no effect here: CUDA graphs need a compiled model on CUDA, not under "
             "FSDP; training without them")
    net, blocks = compile_for(model, mode, compiled=compiled, cuda_graphs=graphs)
    if mode == "fsdp":
        sharded = fsdp.shard(model, dist, param_dtype=precision(t.precision, dist.device))
        note(f"FSDP: {len(sharded)} blocks and the rest of the model sharded over {dist.world} processes")
    elif mode == "ddp":
        net = data_parallel(net, dist, t.grad_reduce, note)
    elif t.grad_reduce != "float32":
        note(f"train.grad_reduce={t.grad_reduce} has no effect here: only DDP over several processes reduces "
             "gradients through it; training on as it is")
    step = StepModule(model, net, dist, ddp=mode == "ddp", compiled=compiled, blocks=blocks, cuda_graphs=graphs,
                      static_shapes=static_shapes, note=note)
    return Parallelized(mode, dist, model, step, copy)


def compile_for(model: nn.Module, mode: str, *, compiled: bool,
                cuda_graphs: bool) -> tuple[nn.Module, list[tuple[nn.Module, Callable]]]:
    """The module the steps call and, under FSDP, each compiled block with its eager forward:
    ``model`` itself when not ``compiled``; under FSDP each transformer block's forward compiled
    on its own (the model stays as it is); else the whole model compiled (:func:`compile_model`)."""
    if not compiled:
        return model, []
    if mode == "fsdp":
        blocks = [(block, block.forward) for block in transformer_blocks(model)]
        for block, forward in blocks:
            block.forward = torch.compile(forward)
        return model, blocks
    return compile_model(model, cuda_graphs), []


def compile_model(model: nn.Module, cuda_graphs: bool) -> nn.Module:
    """``torch.compile(model)``; with ``cuda_graphs`` its forward and backward graphs are captured
    and replayed as CUDA graphs (mode ``reduce-overhead``: one launch where the host would queue
    each kernel; :func:`cuda_graphs_wanted` says when)."""
    return torch.compile(model, mode="reduce-overhead") if cuda_graphs else torch.compile(model)


def data_parallel(net: nn.Module, dist: Dist, grad_reduce: str,
                  note: Callable[[str], None]) -> torch.nn.parallel.DistributedDataParallel:
    """``net`` wrapped in DDP (the gradients averaged over the processes after the backward pass).
    ``grad_reduce="bf16"`` registers torch's ``bf16_compress_hook`` (PyTorch docs: DDP Communication
    Hooks): each gradient bucket is divided by the process count, cast to bf16, all-reduced and cast
    back, so half the bytes cross the wire and the averaged gradients carry bf16 rounding (about
    3 significant digits; the weights, moments and update stay float32). ``"float32"``: DDP's own
    reduction, in the gradients' dtype. Torch accepts the hook only with CUDA and NCCL (or XPU):
    elsewhere (gloo on a CPU) it is noted and the reduction stays float32."""
    ids = [dist.local_rank] if dist.device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids, gradient_as_bucket_view=True)
    if grad_reduce == "bf16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        try:
            ddp.register_comm_hook(None, bf16_compress_hook)  # state None: the default process group
        except TypeError as e:  # DDP's check of the build (CUDA and NCCL), made before anything is registered
            note(f"train.grad_reduce=bf16 has no effect here ({e}); the gradients are reduced in float32")
    return ddp
