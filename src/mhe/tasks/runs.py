"""Start, resume and load runs of a task: the glue between the engine (``mhe.training``) and
the tasks it trains. The commands and the comparison sweeps both go through here."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from mhe.errors import MheError
from mhe.output_paths import check_output_dir, default_run_dir
from mhe.tasks import build_task
from mhe.training import checkpoint as ckpt
from mhe.training.atomic import MANIFEST
from mhe.training.config import RunConfig
from mhe.training.distributed import Dist
from mhe.training.loop import Trainer
from mhe.training.run_files import read_run_config
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


def load_run(path: str | Path, *, data_dir: str = "", inference: bool = False):
    """(model in eval mode, RunConfig, task set up on the run's data) for a run directory
    (its best evaluated weights, else its newest checkpoint) or one of its checkpoint folders.
    ``inference``: set the task up from the run folder alone where it can (translation and
    language modelling read their saved tokenizer and no corpus), for commands that only run
    the model. Keeps the saved weights bit for bit (a strict load of the sealed safetensors)."""
    path = Path(path)
    is_checkpoint = (path / MANIFEST).exists() and path.parent.name == "checkpoints"
    run_dir = path.parent.parent if is_checkpoint else path
    cfg = read_run_config(run_dir)
    if data_dir:
        cfg.data.data_dir = data_dir
    task = build_task(cfg.task)
    model = (task.setup_inference if inference else task.setup)(cfg, run_dir, Dist())
    if not is_checkpoint and has_best(run_dir):  # as results.json used
        load_best(run_dir, model)
    else:
        point = path if is_checkpoint else ckpt.latest_checkpoint(run_dir / "checkpoints")
        if point is None:
            raise MheError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
        load_weights(point, model)
    return model.eval(), cfg, task
