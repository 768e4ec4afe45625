"""Load a finished or running run directory back into a model and its task."""

from __future__ import annotations

from pathlib import Path

from mhe.errors import MheError
from mhe.tasks import build_task
from mhe.training import checkpoint as ckpt
from mhe.training.atomic import MANIFEST
from mhe.training.distributed import Dist
from mhe.training.run_files import read_run_config
from mhe.training.weights import has_best, load_best, load_weights


def load_run(path: str | Path, *, data_dir: str = "", inference: bool = False):
    """(model in eval mode, RunConfig, task set up on the run's data) for a run directory
    (its best evaluated weights, else its newest checkpoint) or one of its checkpoint folders.
    ``inference``: set the task up from the run folder alone where it can (translation reads
    its saved tokenizer and no corpus), for commands that only run the model."""
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
