"""What a training step runs through and what it leaves for the log, without waiting on the GPU.

:class:`StepModule` is the module the steps call, as :func:`~mhe.training.parallelize.parallelize`
made it (checkpointed, compiled, wrapped for FSDP or DDP): it runs each micro-step, in DDP's
no-sync context until the last micro-batch, and where compiling fails on the first one it trains
eagerly after a one-line note (under FSDP it stops with a one-line error: a pass cut short leaves
the shards' state behind).

:class:`StepWindow` keeps each step's loss and gradient norm as device tensors and reads them
once per log interval (one host synchronisation instead of four per step). A non-finite value
still stops the run with the step it happened at: the first one in the window is reported
when the window is read, which the trainer does at every log boundary and before anything
is evaluated or saved, so no checkpoint or best weights come from past a bad step.
"""

from __future__ import annotations

import contextlib
import gc
from typing import Callable

import torch

from mhe.compile_fallback import run_or_fall_back
from mhe.errors import MheError
from mhe.training.config import TrainConfig
from mhe.training.distributed import Dist
from mhe.training.fsdp import plain
from mhe.training.prefetch import Prefetcher
from mhe.training.state import TrainerState
from mhe.training.task import Task


class StepModule:
    """The module of a run's steps: ``net`` is what they call (``model`` compiled and, under DDP,
    wrapped), ``model`` the module itself. ``blocks``: under FSDP, each compiled transformer block
    with its eager forward (the model itself is not compiled); ``compiled``: ``net`` or the blocks
    are compiled; ``cuda_graphs``: the compiled step is replayed as CUDA graphs."""

    def __init__(self, model: torch.nn.Module, net: torch.nn.Module, dist: Dist, *, ddp: bool, compiled: bool,
                 note: Callable[[str], None], blocks: list[tuple[torch.nn.Module, Callable]] | None = None,
                 cuda_graphs: bool = False, static_shapes: bool = True) -> None:
        self.model, self.net, self.note, self.dist = model, net, note, dist
        self.ddp, self.compiled, self.cuda_graphs = ddp, compiled, cuda_graphs
        self.blocks = blocks or []
        self.static_shapes = static_shapes
        self.eager_fallback = False  # compiling failed and the steps run eagerly
        self.proven = not compiled  # a compiled module is proven by its first micro-step

    def release(self) -> None:
        """Free what only the steps use once training ends: the captured graphs and their memory
        pool (the evaluation runs the plain model; a later run in the same process, as a sweep's,
        captures its own), and DDP's wrapper. The wrapper's reducer holds the process group; freed
        only at teardown, a gloo group's destructor could join a thread that waits for the GIL and
        hang the process at exit. Dropped here, it goes while the group is alive."""
        if self.cuda_graphs:
            from torch._inductor import cudagraph_trees

            cudagraph_trees.reset_cudagraph_trees()
        if self.ddp:
            self.net = self.model  # the module itself: DDP's wrapper (and its reducer) has no holder left
            gc.collect()  # the wrapper's reference cycles go now, not at some later collection

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
            with self._whole_graph():
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
        out = micro_step(self.net)
        self.note(f"torch.compile cannot compile this configuration ({why}); training eagerly")
        return out

    @property
    def chunked_loss(self) -> bool | None:
        """The ``chunked_loss`` the step passes its task's loss: False for a step compiled whole
        whose batches change shape (translation, fine-tuning), which scores the output layer with
        the plain loss of its logits, which inductor fuses (no float32 copy of them): the chunked
        loss loops over the rows, and dynamo would compile the step again for every row count
        (:func:`~mhe.models.losses.linear_cross_entropy`); else None (by precision)."""
        whole = self.compiled and not self.blocks and not self.eager_fallback  # FSDP compiles blocks only
        return False if whole and not self.static_shapes else None

    def _whole_graph(self):
        """Under DDP, dynamo compiles the model as one graph (its DDP optimiser, which would split
        it at the gradient buckets, is off while a step runs; :mod:`mhe.training.parallelize` says why)."""
        if self.ddp and self.compiled:
            return torch._dynamo.config.patch(optimize_ddp=False)
        return contextlib.nullcontext()


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


def evaluation_precision(cfg, device: torch.device):
    """Where a run's evaluations compute (the trainer's, and ``mhe eval``'s of a run), by
    ``data.eval_precision``:

    * ``tf32`` (the default): float32 weights and activations; on a GPU the matrix products run
      on TF32 tensor cores (inputs rounded to 10 mantissa bits, float32 sums), about 8x the
      float32 rate that bounds a large model's sliding-window perplexity (paper section 4.5's
      stride of 256 reads every test token in 8 windows). On a CPU: plain float32.
    * ``float32``: IEEE float32 products everywhere.
    * ``train``: under the training steps' autocast (bf16 on a GPU by default); the figures round
      as training does.

    ``cfg``: the run's :class:`RunConfig`."""
    setting = cfg.data.eval_precision
    if setting == "train":
        amp = precision(cfg.train.precision, device)
        return torch.autocast(device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    if setting == "tf32" and device.type == "cuda":
        return float32_matmuls("tf32")
    return contextlib.nullcontext()


MATMUL_BACKENDS = ("cuda", "mkldnn")  # the backends whose float32 product setting the process-wide level spans


def _matmul_backend_settings() -> dict[str, str]:
    """Torch's per-backend float32 product settings (torch 2.9+), by backend; empty on older torch."""
    found = {}
    for name in MATMUL_BACKENDS:
        matmul = getattr(getattr(torch.backends, name, None), "matmul", None)
        if matmul is not None and hasattr(matmul, "fp32_precision"):
            found[name] = matmul.fp32_precision
    return found


@contextlib.contextmanager
def float32_matmuls(mode: str):
    """Float32 matrix products on TF32 (``mode="tf32"``) or IEEE (``"ieee"``) tensor paths for the
    block, the caller's setting restored exactly afterwards (also when the block raises).

    The block runs under the process-wide level (``"high"`` / ``"highest"``), which sets every
    backend's product setting alike, so code inside it (a task's own code, inductor's
    max-autotune) can read ``torch.get_float32_matmul_precision()`` and ``matmul.allow_tf32``.
    Torch 2.9+ also has a per-backend setting (``torch.backends.cuda.matmul.fp32_precision``);
    once a caller set the backends apart, reading the process-wide level raises. So the caller's
    per-backend values are kept and written back one by one, and the process-wide level is
    restored only where it could be read before."""
    backends = _matmul_backend_settings()
    try:
        level = torch.get_float32_matmul_precision()
    except RuntimeError:  # the caller set the backends apart: only their per-backend values restore
        level = None
    torch.set_float32_matmul_precision("high" if mode == "tf32" else "highest")
    try:
        yield
    finally:
        if level is not None:
            torch.set_float32_matmul_precision(level)
        for name, value in backends.items():
            getattr(torch.backends, name).matmul.fp32_precision = value


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
            loss, n = task.loss(net, batch, chunked_loss=step.chunked_loss)
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
