"""Everything a run must carry across an interruption, as one object that saves and restores itself."""

from __future__ import annotations

import contextlib
import os
import random
import re
from dataclasses import dataclass, field

import numpy as np
import torch

from mhe.errors import MheError
from mhe.training.batches import BatchOrder
from mhe.training.state_check import counters_problem, optimizer_problem, rng_problem, scheduler_problem


def rng_state() -> dict:
    """The torch (CPU and CUDA), Python and NumPy generators: tensors and JSON-able meta."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    py = random.getstate()
    np_state = np.random.get_state()
    meta = {"python": [py[0], list(py[1]), py[2]],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])]}
    return {"tensors": tensors, "meta": meta}


def set_rng_state(state: dict) -> None:
    tensors, meta = state["tensors"], state["meta"]
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda_")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    py = meta["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


CUBLAS_DETERMINISTIC = ":4096:8"
"""cuBLAS's workspace setting for reproducible results (CUDA docs, "Results reproducibility"),
which torch's deterministic mode asks for."""


@contextlib.contextmanager
def deterministic_kernels(on: bool):
    """``train.deterministic``: within a run, torch's deterministic algorithms, so that two runs,
    or a run and its resumption, compute the same bits on a GPU. Without it a compiled step is not
    reproducible: inductor sums the embedding's gradient with atomic adds, in whatever order the
    threads arrive (docs/benchmarks.md, "Kill safety"); in deterministic mode it calls torch's
    sorted kernel instead. The mode is process-wide, so it is restored when the run ends (a sweep
    runs others in the same process). An operation without a deterministic kernel stops the run
    in one line naming it (torch's message)."""
    if not on:
        yield
        return
    before = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)  # read before cuBLAS's first call
    torch.use_deterministic_algorithms(True)
    try:
        yield
    except RuntimeError as e:
        op = re.search(r"(\S+) does not have a deterministic implementation", str(e))
        if op is None:
            raise
        raise MheError(f"train.deterministic=true: {op.group(1)} has no deterministic kernel in torch; set "
                       "train.deterministic=false for this model") from e
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@dataclass
class TrainerState:
    """Step, data position, best score, patience count, optimiser, scheduler and (when
    saved) the random generators: what a checkpoint holds besides the weights."""

    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data: BatchOrder
    config_hash: str = ""
    step: int = 0
    best: float | None = None
    bad_evals: int = 0               # evaluations since the best one (early stopping's patience count)
    best_step: int | None = field(default=None)

    def improved(self, score: float, higher_is_better: bool) -> bool:
        """Record an evaluation; True when it is the best so far."""
        if self.best is None or (score > self.best if higher_is_better else score < self.best):
            self.best, self.best_step, self.bad_evals = score, self.step, 0
            return True
        self.bad_evals += 1
        return False

    def state_dict(self) -> dict:
        return {"step": self.step, "data": self.data.state_dict(), "best": self.best, "best_step": self.best_step,
                "bad_evals": self.bad_evals, "config_hash": self.config_hash,
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": rng_state()}

    def problem(self, state: dict, step: int | None, shapes: dict | None = None) -> str | None:
        """How a saved ``state`` disagrees with this run (:func:`state_problem`)."""
        return state_problem(state, step, groups=[g["params"] for g in self.optimizer.param_groups],
                             data=self.data, config_hash=self.config_hash, shapes=shapes)

    def load_state_dict(self, state: dict) -> None:
        self.step, self.best, self.bad_evals = int(state["step"]), state.get("best"), int(state.get("bad_evals", 0))
        self.best_step = state.get("best_step")
        self.config_hash = state.get("config_hash", "")
        self.data.load_state_dict(state["data"])
        # this run's kernel flags (built for its device) go into the saved groups before the load:
        # torch puts a fused or capturable AdamW's step counts on the parameters' device by them
        # (a CPU run's checkpoint resumed by fused AdamW on a GPU would keep them on the host)
        kernels = [{k: g[k] for k in ("fused", "foreach", "capturable") if k in g} for g in self.optimizer.param_groups]
        saved = state["optimizer"]
        self.optimizer.load_state_dict({**saved, "param_groups": [{**g, **own} for g, own in
                                                                   zip(saved["param_groups"], kernels)]})
        self.scheduler.load_state_dict(state["scheduler"])
        if "rng" in state:
            set_rng_state(state["rng"])


def state_problem(state: dict, step: int | None, *, groups: list[list[torch.Tensor]], data: BatchOrder,
                  config_hash: str, shapes: dict | None = None) -> str | None:
    """How a saved trainer ``state`` (from the checkpoint folder of ``step``) disagrees with a run
    (its configuration hash, its optimiser's parameter ``groups`` and its ``data`` order) or with
    itself, or None: checked before anything is loaded (:mod:`mhe.training.state_check`;
    ``shapes``: the parameters' saved shapes, :func:`~mhe.training.state_check.saved_shapes`).
    Needs no optimiser: a run checks a checkpoint before it builds its own."""
    per_epoch = data.n // data.batch
    return (counters_problem(state, step=-1 if step is None else step, config_hash=config_hash,
                             batches_per_epoch=per_epoch)
            or optimizer_problem(state["optimizer"], groups, shapes)
            or scheduler_problem(state["scheduler"], step=state["step"], n_groups=len(groups))
            or rng_problem(state["rng"]))
