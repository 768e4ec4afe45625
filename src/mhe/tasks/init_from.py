"""Continued pre-training: start a run from another run's weights (``train.init_from``).

The new run takes the source run's tokenizer (so the embeddings mean the same ids) and
its newest complete checkpoint's model weights, as fine-tuning does; the optimiser,
schedule and step count start afresh. The model shape must match the source's: the same
preset and the same ``model.*`` settings. ``mhe pretrain --init-from`` takes them from the
source (:func:`continued_run`), so a converted run (``mhe convert``) is uptrained as the kind
it was converted to, with a warm-up suited to continued training.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from mhe.errors import MheError
from mhe.tasks.text import tokenizer_for
from mhe.training.averaging import model_weights
from mhe.training.checkpoint import latest_checkpoint
from mhe.training.config import RunConfig, apply_overrides
from mhe.training.run_files import read_run_config
from mhe.training.weights import load_state_strict

CONTINUED_WARMUP_RATIO = 0.05
"""Warm-up of continued training, as a share of its steps, unless ``train.warmup_*`` is set: the
weights are trained but the optimiser's moment estimates start from zero, so a short ramp
(5% of the run) protects them from the first, badly scaled updates; the pre-training default
(10,000 steps) would outlast an uptraining of a few percent of the original steps."""


def starts_from(cfg, out: Path) -> str:
    """The run to start from: ``train.init_from`` while ``out`` holds no complete checkpoint of
    its own (a resumed or evaluated run loads its own weights, and needs no source any more)."""
    if not cfg.train.init_from or latest_checkpoint(out / "checkpoints", report=lambda _: None) is not None:
        return ""
    return cfg.train.init_from


def source_checkpoint(run_dir: str | Path) -> Path:
    """The newest complete checkpoint of a run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise MheError(f"train.init_from={run_dir} is not a run directory (no config.json)")
    point = latest_checkpoint(run_dir / "checkpoints", report=lambda _: None)
    if point is None:
        raise MheError(f"train.init_from={run_dir} has no complete checkpoint under checkpoints/")
    return point


def adopt_tokenizer(run_dir: str | Path, out: Path) -> None:
    """Copy the source run's ``tokenizer.json`` into ``out`` (kept when ``out`` already has one:
    a resumed run; refused when that one differs)."""
    src = Path(run_dir) / "tokenizer.json"
    if not src.is_file():
        raise MheError(f"train.init_from={run_dir} has no tokenizer.json")
    dst = out / "tokenizer.json"
    if dst.is_file():
        if json.loads(dst.read_text()) != json.loads(src.read_text()):
            raise MheError(f"{out} already holds another tokenizer than train.init_from={run_dir}")
        return
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".tokenizer.json.tmp"
    shutil.copyfile(src, tmp)
    tmp.replace(dst)


def pretraining_tokenizer(cfg, out: Path, train_lines: list[str], *, task: str, dist):
    """(source run or "", tokenizer) of a pre-training run: continued pre-training
    (``train.init_from``) takes the source's tokenizer, so the embeddings mean the same ids;
    otherwise one is trained on ``train_lines`` (or reused on resume, :func:`tokenizer_for`)."""
    source = starts_from(cfg, out)
    if source and (dist is None or dist.main):
        adopt_tokenizer(source, out)
    return source, tokenizer_for(cfg, out, train_lines, task=task, dist=dist)


def init_weights(model: nn.Module, run_dir: str | Path) -> Path:
    """Load the source run's newest weights into ``model``; returns the checkpoint used.

    Shapes and names must match exactly (tied output weights aside). Keeps the source's weights
    bit for bit (a strict load of its sealed safetensors)."""
    point = source_checkpoint(run_dir)
    state = model_weights(point)
    own = model.state_dict()
    for k, t in state.items():
        if k in own and own[k].shape != t.shape:
            raise MheError(f"train.init_from={run_dir}: {k} is {tuple(t.shape)} there but {tuple(own[k].shape)} "
                           "here; use the source's preset and model.* settings")
    load_state_strict(model, state, source=point)
    return point


def source_config(run_dir: str | Path) -> RunConfig:
    """The configuration of the run to start from (a one-line error when it is not a run)."""
    if not (Path(run_dir) / "config.json").is_file():
        raise MheError(f"--init-from {run_dir} is not a run directory (no config.json)")
    return read_run_config(run_dir)


def continued_run(cfg: RunConfig, source: RunConfig, overrides: list[str]) -> RunConfig:
    """``cfg`` with the source run's model (kind and its options included) and the run's own
    ``model.*`` items on top; the continued warm-up unless ``overrides`` set one."""
    cfg.model = source.model.replace()
    items = [o for o in overrides if o.split("=", 1)[0].strip().startswith("model.")]
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if not keys & {"train.warmup_steps", "train.warmup_ratio"}:
        items.append(f"train.warmup_ratio={CONTINUED_WARMUP_RATIO}")
    return apply_overrides(cfg, items)
