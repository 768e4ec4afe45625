"""Default run settings per task and preset (fine-tuning's: ``mhe.tasks.finetune_config``).

Full-size presets keep the paper's Appendix B values (pre-training: lr 1e-4,
linear schedule, 10k warmup, betas 0.9/0.9999, eps 1e-8, weight decay 0.01,
dropout 0.1). ``tiny-*`` presets and ``llama-tiny`` (:func:`~mhe.models.config.cpu_sized`) get short schedules sized for a CPU.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from mhe.models.config import cpu_sized
from mhe.models.config import preset as get_preset
from mhe.training.config import DataConfig, RunConfig, TrainConfig, apply_overrides

TINY_TRAIN = dict(steps=600, batch_size=32, lr=1e-3, warmup_steps=60, schedule="cosine", log_every=10,
                  save_every=200, eval_every=0)

RECALL_TRAIN = dict(steps=1000, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine", log_every=20,
                    save_every=250, weight_decay=0.0, betas=(0.9, 0.98))
RECALL_MODEL = dict(d_model=64, d_ff=256, n_layers=2, n_heads=4, dropout=0.0, attn_dropout=0.0)


def default_run(task: str, preset: str, attention: str, dataset: str = "") -> RunConfig:
    """The task's default run for a model preset and attention kind (``model.attention``)."""
    train = TrainConfig()
    model: dict = {}
    if cpu_sized(preset):
        train = TrainConfig(**TINY_TRAIN)
    if task == "mt":
        # Vaswani et al. (2017) section 5.3: Adam betas (0.9, 0.98), eps 1e-9, inverse square-root
        # decay after 4000 warm-up steps, label smoothing 0.1; lr peak = 512^-0.5 * 4000^-0.5
        train = TrainConfig(steps=100_000, batch_size=1, lr=7e-4, schedule="inverse_sqrt", warmup_steps=4000,
                            betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0, label_smoothing=0.1,
                            log_every=50, eval_every=2000, save_every=2000, clip_norm=0.0)
        if cpu_sized(preset):
            train.steps, train.warmup_steps, train.lr, train.eval_every, train.save_every = 300, 100, 2e-3, 0, 100
            train.log_every = 10
    if task in ("lm", "mlm") and cpu_sized(preset):
        # 16 x 64 tokens a step: a 10k-word softmax stays cheap on two CPU cores
        train.batch_size = 16
        model = {"max_len": 64}
    data = DataConfig(dataset=dataset)
    if task == "lm" and cpu_sized(preset) and dataset == "wikitext-2":
        data.tokenizer = "word"  # the tokenised WikiText-2 is a word-level corpus (33k words)
    if task == "recall":
        train = TrainConfig(**RECALL_TRAIN)
        if cpu_sized(preset):
            model = dict(RECALL_MODEL)
    return RunConfig(task=task, preset=preset, model=get_preset(preset).replace(attention=attention, **model),
                     train=train, data=data)


def build_run(task: str, preset: str, *, attention: str = "mha", data: str = "", data_dir: str = "",
              seed: int | None = None, overrides: Sequence[str] = (), task_options: dict | None = None) -> RunConfig:
    """A run's typed configuration as the training commands build it: the task's defaults, then
    the attention kind, the data folder, the seed, the task options and every ``--set`` item
    (in that order, so a ``--set`` item wins), all checked before anything is read or written.
    The run starts from the preset's own kind, so a kind of the same family keeps the preset's
    options (``--preset llama-135m --attention gqa``: its 3 K/V heads)."""
    cfg = default_run(task, preset, get_preset(preset).attention, data)
    items = [f"model.attention={attention}"]
    if data_dir:
        cfg.data.data_dir = data_dir
    if seed is not None:
        items.append(f"train.seed={seed}")
    if task_options:
        items.append(f"data.task_options={json.dumps(task_options)}")
    return apply_overrides(cfg, items + list(overrides))
