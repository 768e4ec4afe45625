"""A fine-tuning run's configuration: Appendix B's schedule per benchmark task, on the model of
a pre-training run."""

from __future__ import annotations

from collections.abc import Sequence

from mhe.data.benchmarks import bench_task
from mhe.models.config import preset as get_preset
from mhe.training.config import DataConfig, RunConfig, TrainConfig, apply_overrides
from mhe.training.run_files import read_run_config

# Appendix B, Table 12: evaluation steps per task (also our checkpoint cadence)
EVAL_STEPS = {"mnli": 2455, "mnli-mm": 2455, "qnli": 655, "qqp": 2275, "rte": 48, "sst2": 421, "mrpc": 69,
              "cola": 162, "stsb": 108, "boolq": 177, "cb": 5, "sg-rte": 47, "wic": 102, "multirc": 512,
              "copa": 8, "wsc": 11, "squad": 548, "squad-v2": 815}
SQUAD_WARMUP = {"squad": 3327, "squad-v2": 4950}


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


def finetune_config(task: str, checkpoint: str, *, data_dir: str = "", overrides: Sequence[str] = (),
                    seed: int = 0) -> RunConfig:
    """Fine-tuning ``checkpoint`` (a pre-training run) on benchmark task ``task``: the
    pre-training run's preset and attention kind, Appendix B's fine-tuning schedule, then
    ``overrides`` (``model.*`` items change the model from the preset) and the seed."""
    bench_task(task)
    pre = read_run_config(checkpoint)
    # the model itself comes from the checkpoint; model.* settings here change it from the preset
    cfg = RunConfig(task="finetune", preset=pre.preset, model=get_preset(pre.preset).replace(attention=pre.kind),
                    train=finetune_train(task),
                    data=DataConfig(dataset=task, data_dir=data_dir,
                                    task_options={"task": task, "checkpoint": str(checkpoint)}))
    cfg = apply_overrides(cfg, list(overrides))
    cfg.train.seed = seed
    return cfg
