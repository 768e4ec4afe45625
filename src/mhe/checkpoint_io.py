"""Load a finished or running run directory back into a model and its task."""

from __future__ import annotations

import json
from pathlib import Path

from mhe.errors import MheError


def load_run(path: str | Path, *, data_dir: str = ""):
    """(model in eval mode, RunConfig, task set up on the run's data) for a run directory
    or one of its checkpoint folders."""
    from mhe.tasks import build_task
    from mhe.training import checkpoint as ckpt
    from mhe.training.config import RunConfig
    from mhe.training.distributed import Dist

    path = Path(path)
    run_dir = path.parent.parent if (path / "manifest.json").exists() else path
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise MheError(f"{run_dir} is not a run directory (no config.json)")
    cfg = RunConfig.from_dict(json.loads(cfg_file.read_text())["run"])
    if data_dir:
        cfg.data.data_dir = data_dir
    task = build_task(cfg.task)
    model = task.setup(cfg, run_dir, Dist())
    point = path if (path / "manifest.json").exists() else ckpt.latest_checkpoint(run_dir / "checkpoints")
    if point is None:
        raise MheError(f"no complete checkpoint under {run_dir / 'checkpoints'}")
    best = run_dir / "best" / "model.safetensors"
    if path == run_dir and best.exists():  # a run directory: its best evaluated weights, as results.json used
        from safetensors.torch import load_file

        model.load_state_dict(load_file(str(best)), strict=False)
    else:
        ckpt.load_weights(point, model)
    return model.eval(), cfg, task
