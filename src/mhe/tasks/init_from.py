"""Continued pre-training: start a run from another run's weights (``train.init_from``).

The new run takes the source run's tokenizer (so the embeddings mean the same ids) and
its newest complete checkpoint's model weights, as fine-tuning does; the optimiser,
schedule and step count start afresh. The model is the source's: ``mhe pretrain --init-from``
takes its preset, kind and ``model.*`` settings (:func:`continued_run`, given the source's
configuration) and refuses a ``--preset``, ``--attention`` or ``model.*`` item that differs from
them, so the new run's ``config.json`` describes the model it trains, and a converted run
(``mhe convert``) is uptrained as the kind it was converted to, with a warm-up suited to
continued training.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
from pathlib import Path

from torch import nn

from mhe.errors import MheError
from mhe.tasks.text import tokenizer_for
from mhe.training.checkpoint import latest_checkpoint
from mhe.training.config import RunConfig, apply_overrides
from mhe.training.run_files import require_run_dir
from mhe.training.weights import load_weights

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
    """The newest complete checkpoint of a run folder."""
    run_dir = require_run_dir(run_dir, "train.init_from")
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
    """Load the source run's newest weights into ``model`` (the one strict reader,
    :func:`mhe.training.weights.load_weights`); returns the checkpoint used. Shapes and names
    must match exactly (tied output weights aside); the source's weights are kept bit for bit."""
    point = source_checkpoint(run_dir)
    try:
        load_weights(point, model)
    except MheError as e:
        raise MheError(f"train.init_from={run_dir}: {e}; use the source's preset and model.* settings") from e
    return point


RUN_SETTINGS = ("dropout", "attn_dropout", "attn_kernel")
"""``model.*`` settings of how the model trains or runs, not of what it computes: a continued run
may change them (dropout rates; the attention kernel, which never changes results)."""


def _differences(old, new, prefix: str) -> list[str]:
    """``prefix.field=new (the source's: old)`` for every field that differs (options dataclasses
    compared field by field)."""
    out = []
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if a == b or (prefix == "model" and f.name in RUN_SETTINGS):
            continue
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            out += _differences(a, b, f"{prefix}.{f.name}")
        else:
            out.append(f"{prefix}.{f.name}={b} (the source's: {a})")
    return out


def continued_run(cfg: RunConfig, source: RunConfig, overrides: list[str], *, run: str = "",
                  preset: str | None = None, attention: str | None = None) -> RunConfig:
    """``cfg`` with the source run's model (kind and its options included), so that the run's
    ``config.json`` describes the model it trains; the continued warm-up unless ``overrides`` set one.

    The architecture is the source's: a ``preset``, ``attention`` kind or ``model.*`` item of
    ``overrides`` that differs from it is refused in one line naming every difference (a new
    kind goes through ``mhe convert``); only :data:`RUN_SETTINGS` may change."""
    cfg.model = source.model.replace()
    items = [o for o in overrides if o.split("=", 1)[0].strip().startswith("model.")]
    changed = apply_overrides(copy.deepcopy(cfg), items)
    diffs = _differences(source.model, changed.model, "model")
    if attention is not None and attention != source.kind:
        diffs.insert(0, f"--attention {attention} (the source's: {source.kind}; a new kind: mhe convert "
                        f"--checkpoint {run} --attention {attention}, then --init-from the converted run)")
    if preset is not None and preset != (source.preset or None):
        diffs.insert(0, f"--preset {preset} (the source's: {source.preset or 'none, its sizes are its own'})")
    if diffs:
        raise MheError(f"--init-from {run} trains the source run's model, and these differ from it: "
                       f"{'; '.join(diffs)}; drop them (only model.{', model.'.join(RUN_SETTINGS)} may change)")
    keys = {o.split("=", 1)[0].strip() for o in overrides}
    if not keys & {"train.warmup_steps", "train.warmup_ratio"}:
        items.append(f"train.warmup_ratio={CONTINUED_WARMUP_RATIO}")
    return apply_overrides(cfg, items)
