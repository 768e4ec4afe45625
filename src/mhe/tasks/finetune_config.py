"""A fine-tuning run's settings: its ``data.task_options``, Appendix B's schedule per benchmark
task, the checks made before a run starts, and the configuration of fine-tuning a pre-training
run."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from mhe.data.benchmarks import bench_task, finetuning_tasks, task_files
from mhe.errors import MheError
from mhe.models.config import family_preset
from mhe.output_paths import default_run_dir
from mhe.settings import setting
from mhe.tasks.run_tokenizer import refuse_ids_only_run
from mhe.training.config import DataConfig, RunConfig, TrainConfig, apply_overrides
from mhe.training.atomic import verify
from mhe.training.run_files import locate_run, read_run_record, require_run_dir
from mhe.training.task import Task

# Appendix B, Table 12: evaluation steps per task (also our checkpoint cadence)
EVAL_STEPS = {"mnli": 2455, "mnli-mm": 2455, "qnli": 655, "qqp": 2275, "rte": 48, "sst2": 421, "mrpc": 69,
              "cola": 162, "stsb": 108, "boolq": 177, "cb": 5, "sg-rte": 47, "wic": 102, "multirc": 512,
              "copa": 8, "wsc": 11, "squad": 548, "squad-v2": 815}
SQUAD_WARMUP = {"squad": 3327, "squad-v2": 4950}


@dataclass(frozen=True)
class FinetuneOptions:
    """``data.task_options`` of fine-tuning: the benchmark ``task`` (rte, ..., squad-v2) and the
    pre-training run ``checkpoint``; splits (offline SQuAD has no train file, so tests train on
    a labelled part of dev starting at ``dev_offset``), limits, and SQuAD's ``doc_stride`` and
    ``max_answer_len``."""

    task: str = ""
    checkpoint: str = ""
    train_split: str = "train"
    dev_split: str = "dev"
    train_limit: int = setting(0, ge=0)
    dev_limit: int = setting(0, ge=0)
    doc_stride: int = setting(128, gt=0)
    max_answer_len: int = setting(30, gt=0)
    dev_offset: int = setting(0, ge=0)


def finetune_train(bench: str) -> TrainConfig:
    """Appendix B fine-tuning: batch 32, lr 3e-5 (GLUE, SQuAD) or 5e-5 (SuperGLUE), cosine with
    hard restarts, 6% warm-up (SQuAD: 3327 / 4950 steps), Adam eps 1e-6, betas 0.9/0.999, no
    weight decay, up to 20 epochs with early stopping (patience: 5 evaluations, our choice)."""
    spec = bench_task(bench)
    every = EVAL_STEPS.get(bench, 0)
    return TrainConfig(epochs=20, batch_size=32, lr=5e-5 if spec.benchmark == "superglue" else 3e-5,
                       schedule="cosine_restarts", warmup_ratio=0.0 if bench in SQUAD_WARMUP else 0.06,
                       warmup_steps=SQUAD_WARMUP.get(bench, 0), eps=1e-6, betas=(0.9, 0.999), weight_decay=0.0,
                       patience=5, eval_every=every, save_every=every, log_every=10)


def check_finetuning_task(name: str) -> None:
    """A benchmark task that can be fine-tuned (the diagnostics have a test split only)."""
    spec = bench_task(name)
    if spec.kind == "diagnostic":
        raise MheError(f"{name} is a diagnostic with a test split only: fine-tune on rte, then score it with "
                       "mhe diagnostics")


def pretraining_checkpoint(path: str, option: str = "--run") -> tuple[Path, Path]:
    """(run folder, checkpoint) of a pre-training run: the checkpoint ``path`` names, or the
    run's newest complete one (one-line errors)."""
    run, point = locate_run(path, option)
    if point is not None:
        problem = verify(point)
        if problem is not None:
            raise MheError(f"{option} {path} cannot be loaded: {problem}")
        return run, point
    from mhe.training.checkpoint import latest_checkpoint  # here: the settings above are read without torch

    point = latest_checkpoint(run / "checkpoints", report=lambda _: None)
    if point is None:
        raise MheError(f"{option} {path}: no complete checkpoint under {run / 'checkpoints'}")
    return run, point


def default_finetune_dir(task: str, checkpoint: str) -> Path:
    """``runs/finetune-TASK-RUN-HASH``: ``RUN`` is the pre-training run folder's name and
    ``HASH`` six hex digits of its resolved path, its configuration hash and the checkpoint
    named (if any), so that different pre-training runs never share a fine-tuning folder."""
    run, point = locate_run(checkpoint, "--run")
    record = read_run_record(run)
    key = "\n".join([str(run.resolve()), str(record.get("config_hash", "")), point.name if point else ""])
    return default_run_dir("finetune", task, run.resolve().name, hashlib.sha256(key.encode()).hexdigest()[:6])


class FinetuneSettings(Task):
    """The settings half of :class:`mhe.tasks.finetune.FinetuneTask`."""

    name = "finetune"
    summary = "fine-tuning a pre-training run on GLUE, SuperGLUE or SQuAD"
    command = "finetune"
    options = FinetuneOptions

    @classmethod
    def default_train(cls, preset, dataset):
        return finetune_train(dataset)

    @classmethod
    def default_data(cls, preset, dataset):
        return DataConfig(dataset=dataset, task_options=FinetuneOptions(task=dataset))

    def check(self, cfg):
        o = cfg.data.task_options
        check_finetuning_task(o.task)
        if not o.checkpoint:
            raise MheError("fine-tuning needs --run (a pre-training run folder)")
        pretraining_checkpoint(o.checkpoint)
        if cfg.data.source == "local":
            for split in {o.train_split, o.dev_split}:
                task_files(o.task, split, data_dir=cfg.data.data_dir or None)


def _conventions(record: dict) -> str:
    """The preset whose fine-tuning defaults a pre-training run takes: its own, or for a run of no
    preset (a converted Hugging Face checkpoint) its family's (:func:`mhe.models.config.family_preset`)."""
    if record["run"]["preset"]:
        return record["run"]["preset"]
    return family_preset(SimpleNamespace(arch=record["model"].get("arch"), positions=record["model"].get("positions")))


def finetune_config(task: str, checkpoint: str, *, data_dir: str = "", overrides: Sequence[str] = (),
                    seed: int = 0) -> RunConfig:
    """Fine-tuning ``checkpoint`` (a pre-training run) on benchmark task ``task``: the
    pre-training run's preset and attention kind, Appendix B's fine-tuning schedule, then
    ``overrides`` (``model.*`` items change the model from the preset) and the seed."""
    check_finetuning_task(task)
    record = read_run_record(require_run_dir(checkpoint, "--run"))
    refuse_ids_only_run(checkpoint, "--run", doing=f"encode the text of {task}")
    # the model itself comes from the checkpoint; model.* settings here change it from the preset
    cfg = FinetuneSettings.default_config(_conventions(record), attention=record["model"]["attention"],
                                          dataset=task)
    cfg.data.data_dir = data_dir
    cfg.data.task_options = FinetuneOptions(task=task, checkpoint=os.path.normpath(str(checkpoint)))
    cfg = apply_overrides(cfg, list(overrides))
    cfg.train.seed = seed
    return cfg


__all__ = ["EVAL_STEPS", "FinetuneOptions", "FinetuneSettings", "default_finetune_dir", "finetune_config",
           "finetune_train", "finetuning_tasks", "pretraining_checkpoint"]
