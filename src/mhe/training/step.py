"""What a training step runs through and what it leaves for the log, without waiting on the GPU.

:class:`StepModule` is the module the steps call: the model, compiled where
:func:`~mhe.training.config.compile_wanted` says so, and wrapped for DDP when several processes
train. Under DDP the compiled model is wrapped (compiled first) and compiled whole, without
dynamo's DDP optimiser: splitting the graph at the gradient buckets would let each bucket's
all-reduce overlap the backward pass, but the step is bound by the host's time to queue its
kernels, and the split graph (and dynamo's breaks in DDP's own forward) cost more host time
than the overlap saves (docs/benchmarks.md section 7: 55 ms against 39 ms per step for
gpt2-base at 16 rows per GPU on two H100s); the buckets are reduced after the backward pass,
about 2 ms on NVLink for gpt2-base's float32 gradients (``train.grad_reduce=bf16`` sends them as
bf16, half the bytes: :func:`data_parallel`). Under FSDP the
model is already sharded (:mod:`mhe.training.fsdp`) and each transformer block's forward is
compiled on its own, as torchtitan does, between the hooks that gather and free its weights.
Where batches have one shape (pre-training) the compiled step is also replayed as CUDA graphs
(:func:`~mhe.training.config.cuda_graphs_wanted`): the host queues a replay instead of each of
the step's kernels, which is what bounds a compiled step at small batches or many layers.
A configuration that torch.compile cannot handle trains eagerly after a one-line note (under
FSDP it stops with a one-line error: a pass cut short leaves the shards' state behind).

:class:`StepWindow` keeps each step's loss and gradient norm as device tensors and reads them
once per log interval (one host synchronisation instead of four per step). A non-finite value
still stops the run with the step it happened at: the first one in the window is reported
when the window is read, which the trainer does at every log boundary and before anything
is evaluated or saved, so no checkpoint or best weights come from past a bad step.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from mhe.compile_fallback import run_or_fall_back
from mhe.errors import MheError
from mhe.models.losses import chunked_loss
from mhe.training.activation_checkpointing import transformer_blocks
from mhe.training.config import TrainConfig
from mhe.training.distributed import Dist
from mhe.training.fsdp import plain
from mhe.training.prefetch import Prefetcher
from mhe.training.state import TrainerState
from mhe.training.task import Task


class StepModule:
    """The (DDP-wrapped, compiled) module of a run; ``net`` is what the steps call. ``mode``:
    ``none``, ``ddp`` or ``fsdp`` (:class:`~mhe.training.parallel.Parallel`)."""

    def __init__(self, model: torch.nn.Module, dist: Dist, *, compiled: bool, note: Callable[[str], None],
                 mode: str = "ddp", cuda_graphs: bool = False, static_shapes: bool = True,
                 grad_reduce: str = "float32") -> None:
        self.model, self.note, self.dist = model, note, dist
        self.ddp = mode == "ddp" and dist.world > 1
        self.compiled = compiled
        self.static_shapes = static_shapes
        self.eager_fallback = False  # compiling failed and the steps run eagerly
        self.cuda_graphs = compiled and cuda_graphs and mode != "fsdp"
        self.blocks: list[tuple[torch.nn.Module, Callable]] = []  # FSDP: (block, its eager forward)
        if compiled and mode == "fsdp":
            self.blocks = [(block, block.forward) for block in transformer_blocks(model)]
            for block, forward in self.blocks:
                block.forward = torch.compile(forward)
        self.net = compile_model(model, self.cuda_graphs) if compiled and mode != "fsdp" else model
        if self.ddp:
            self.net = data_parallel(self.net, dist, grad_reduce, note)
        elif grad_reduce != "float32":
            note(f"train.grad_reduce={grad_reduce} has no effect here: only DDP over several processes reduces "
                 "gradients through it; training on as it is")
        self.proven = not compiled  # a compiled module is proven by its first micro-step

    def release(self) -> None:
        """Free the captured graphs and their memory pool once training ends (the evaluation runs
        the plain model; a later run in the same process, as a sweep's, captures its own)."""
        if self.cuda_graphs:
            from torch._inductor import cudagraph_trees

            cudagraph_trees.reset_cudagraph_trees()

    def sync(self, last: bool):
        """The context of a micro-step: DDP's all-reduce waits for the last micro-batch of the step
        (FSDP reduces every micro-batch's gradients into the shards)."""
        return self.net.no_sync() if self.ddp and not last else contextlib.nullcontext()

    def run(self, micro_step: Callable[[torch.nn.Module], object]):
        """``micro_step(net)`` (forward and backward of one micro-batch); if compiling fails on the
        first one, note it and run it (and every later one) eagerly. An error the eager module
        raises as well is the configuration's own and is raised. Under FSDP a compile failure is
        a one-line error naming ``train.compile=false``."""
        if self.cuda_graphs:  # the last step's graph outputs (loss, gradients) have been consumed
            torch.compiler.cudagraph_mark_step_begin()
        def compiled():
            with self._whole_graph(), self._loss_choice():
                return micro_step(self.net)
        if self.proven:
            return compiled()
        out = run_or_fall_back(compiled, lambda error, why: self._eager(micro_step, error, why))
        self.proven = True
        return out

    def _eager(self, micro_step: Callable[[torch.nn.Module], object], error: Exception, why: str):
        """Run ``micro_step`` (and every later one) on the eager module after compiling failed with
        ``error`` (``why``: its one line); under FSDP, a one-line error instead."""
        if self.blocks:  # FSDP's gather/free state cannot be rewound from a pass cut short
            raise MheError(f"torch.compile cannot compile this configuration under FSDP ({why}); "
                           "set train.compile=false to train it eagerly") from error
        if self.ddp:  # the same DDP wrapper (its hooks are on the parameters), eager inside
            self.net.module = self.model
        else:
            self.net = self.model
        self.model.zero_grad(set_to_none=True)  # a backward pass cut short leaves partial gradients
        self.eager_fallback = True
        with self._loss_choice():
            out = micro_step(self.net)
        self.note(f"torch.compile cannot compile this configuration ({why}); training eagerly")
        return out

    def _loss_choice(self):
        """A step compiled whole whose batches change shape (translation, fine-tuning) scores the
        output layer with the plain loss of its logits, which inductor fuses (no float32 copy of them):
        the chunked loss loops over the rows, and dynamo would compile the step again for every
        row count (:func:`~mhe.models.losses.linear_cross_entropy`)."""
        whole = self.compiled and not self.blocks and not self.eager_fallback  # FSDP compiles blocks only
        return chunked_loss(False) if whole and not self.static_shapes else contextlib.nullcontext()

    def _whole_graph(self):
        """Under DDP, dynamo compiles the model as one graph (its DDP optimiser, which would split
        it at the gradient buckets, is off while a step runs; the module docstring says why)."""
        if self.ddp and self.compiled:
            return torch._dynamo.config.patch(optimize_ddp=False)
        return contextlib.nullcontext()


def data_parallel(net: torch.nn.Module, dist: Dist, grad_reduce: str,
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


def compile_model(model: torch.nn.Module, cuda_graphs: bool) -> torch.nn.Module:
    """``torch.compile(model)``; with ``cuda_graphs`` its forward and backward graphs are captured
    and replayed as CUDA graphs (mode ``reduce-overhead``: one launch where the host would queue
    each kernel; :func:`~mhe.training.config.cuda_graphs_wanted` says when)."""
    return torch.compile(model, mode="reduce-overhead") if cuda_graphs else torch.compile(model)


class StepWindow:
    """Each step's loss and gradient norm since the last read, as device tensors."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.values: list[torch.Tensor] = []  # [loss, grad norm] per step

    def add(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.steps.append(step)
        self.values.append(torch.stack([loss.detach().float(), grad_norm.detach().float()]))

    def read(self, dist: Dist, stopped: Callable[[int, str, float], Exception]) -> dict | None:
        """The last step's loss (mean over processes) and gradient norm; raises
        ``stopped(step, what, value)`` for the first step whose loss or norm is not finite
        (on every process alike). None when no step ran since the last read."""
        if not self.steps:
            return None
        rows = torch.stack(self.values)  # [steps, 2]
        if dist.world > 1:  # the losses of every process; a NaN on one reaches all
            loss = rows[:, 0].to(torch.float64)
            torch.distributed.all_reduce(loss)
            rows = torch.stack([loss / dist.world, rows[:, 1].to(torch.float64)], 1)
        values = rows.tolist()  # the one synchronisation
        steps, self.steps, self.values = self.steps, [], []
        for step, (loss, norm) in zip(steps, values):
            for what, v in (("loss", loss), ("gradient norm", norm)):
                if v != v or v in (float("inf"), float("-inf")):
                    raise stopped(step, what, v)
        return {"loss": values[-1][0], "grad_norm": values[-1][1]}


def precision(setting: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of ``train.precision`` (auto: bf16 on CUDA), None for float32."""
    return torch.bfloat16 if setting == "bf16" or (setting == "auto" and device.type == "cuda") else None


def train_step(step: StepModule, data: Prefetcher, state: TrainerState, task: Task, t: TrainConfig, dist: Dist,
               window: StepWindow) -> int:
    """One optimiser step over ``grad_accum`` micro-batches, queued without waiting for the
    device; its loss and gradient norm go to ``window``. Returns the tokens it scored."""
    amp = precision(t.precision, dist.device)
    if not step.model.training:  # model.train() visits every module: only after an evaluation
        step.model.train()
    loss_sum, n_tok = 0.0, 0

    def micro_step(net, batch, last):
        with step.sync(last), torch.autocast(dist.device.type, dtype=amp, enabled=amp is not None):
            loss, n = task.loss(net, batch)
        (loss / t.grad_accum).backward()
        return loss.detach(), n

    for micro in range(t.grad_accum):
        batch = data.next()
        loss, n = step.run(lambda net: micro_step(net, batch, micro == t.grad_accum - 1))
        data.prepare()  # the next batch, while the device runs this one's backward pass
        loss_sum, n_tok = loss_sum + loss / t.grad_accum, n_tok + n
    max_norm = t.clip_norm if t.clip_norm > 0 else float("inf")
    gnorm = plain(torch.nn.utils.clip_grad_norm_(step.model.parameters(), max_norm))  # FSDP: of every shard
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    window.add(state.step, loss_sum, gnorm)
    return int(n_tok) * dist.world
