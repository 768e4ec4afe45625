"""Start, resume and load runs of a task: the glue between the engine (``mhe.training``) and
the tasks it trains. The commands and the comparison sweeps both go through here."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import torch

from mhe.errors import MheError
from mhe.output_paths import check_output_dir, default_run_dir
from mhe.tasks import build_task, read_run_config
from mhe.training import checkpoint as ckpt
from mhe.training.config import RunConfig
from mhe.training.distributed import Dist
from mhe.training.run_files import locate_run
from mhe.training.loop import Trainer
from mhe.training.weights import has_best, load_best, load_weights


def run_dir_for(cfg: RunConfig) -> str:
    """Where a run goes when no ``--out`` is given: ``runs/TASK-DATA-PRESET-KIND``
    (:func:`mhe.output_paths.default_run_dir`)."""
    return str(default_run_dir(cfg.task, cfg.data.dataset, cfg.preset, cfg.model.attention))


def run_training(cfg: RunConfig, out: str | Path = "", resume: bool = False, *, log=None) -> dict:
    """Train (or resume) one run into ``out``; returns its results with ``out`` added.

    ``out`` is checked before any data is read, so a bad folder fails at once.
    """
    out = str(out or run_dir_for(cfg))
    check_output_dir(out)
    log = log or (lambda m: print(m, file=sys.stderr))
    result = Trainer(cfg, build_task(cfg.task), out, resume=resume, log=log).fit()
    return {**result, "out": out}


def exit_status(res: dict) -> int:
    """0 for a run that finished (or stopped where ``train.stop_at`` said); 128 + the signal
    number (130 for SIGINT, 143 for SIGTERM) for a run a signal interrupted after saving."""
    if res.get("status") == "interrupted":
        return 128 + int(res.get("signal") or signal.SIGINT)
    return 0


def made_current(device: torch.device) -> torch.device:
    """``device`` with its index (``cuda`` is the current card), made the current CUDA device:
    beam search's graph capture and the Triton kernels launch on the current device, and
    ``torch.cuda.set_device`` refuses a ``cuda`` without an index."""
    if device.type != "cuda":
        return device
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    return device


def load_run(path: str | Path, *, data_dir: str = "", inference: bool = False, tasks: tuple[str, ...] = (),
             needs: str = "", option: str = "--run", device: torch.device | None = None):
    """(model in eval mode, RunConfig, task set up) for a run folder (its best evaluated weights,
    else its newest checkpoint) or one of its checkpoint folders.

    Args:
        path: the run folder or ``RUN/checkpoints/step-N``.
        data_dir: the data folder, where the task reads data.
        inference: set the task up from the run folder alone where it can (language modelling
            and translation read their saved tokenizer and no corpus; masked LM only its
            validation split), for commands that only run or score the model.
        tasks: the run's task must be one of these (checked before anything is set up);
            ``needs`` says in words what the command needs, for the error.
        option: the command line option that named ``path``, for errors.
        device: where the model and the task's batches go (default: the CPU).

    The saved weights are kept bit for bit (a strict load of the sealed safetensors).
    """
    run_dir, point = locate_run(path, option)
    cfg = read_run_config(run_dir)
    if tasks and cfg.task not in tasks:
        raise MheError(f"{path} is a {cfg.task!r} run; {needs or 'this command needs a ' + ' or '.join(tasks) + ' run'}")
    if data_dir:
        cfg.data.data_dir = data_dir
    task = build_task(cfg.task)
    device = made_current(device or torch.device("cpu"))
    model = (task.setup_inference if inference else task.setup)(cfg, run_dir, Dist(device=device))
    if point is None and has_best(run_dir):  # as results.json used
        load_best(run_dir, model)
    else:
        point = point or ckpt.latest_checkpoint(run_dir / "checkpoints")
        if point is None:
            raise MheError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
        load_weights(point, model)
    return model.to(device).eval(), cfg, task
