"""What the trainer needs from a task; language modelling, MLM, recall, ... implement it.

A task also owns its settings: the class of its ``data.task_options`` (``options``) and its
default run for a model preset (:meth:`Task.default_config`). Full-size presets keep the
paper's Appendix B values (pre-training: lr 1e-4, linear schedule, 10k warm-up, betas
0.9/0.9999, eps 1e-8, weight decay 0.01, dropout 0.1); ``tiny-*`` presets get short
schedules sized for a CPU, as does ``llama-tiny``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mhe.attention.spec import AttentionSpec
from mhe.errors import MheError
from mhe.models.config import cpu_sized
from mhe.models.config import preset as get_preset
from mhe.training.config import DataConfig, NoTaskOptions, RunConfig, TrainConfig

if TYPE_CHECKING:  # a task's settings and defaults are read without torch
    import torch

    from mhe.training.distributed import Dist

# tiny presets: a schedule that runs on a CPU in minutes
TINY_TRAIN = dict(steps=600, batch_size=32, lr=1e-3, warmup_steps=60, schedule="cosine", log_every=10,
                  save_every=200, eval_every=0)


def is_tiny(preset: str) -> bool:
    """The CPU-sized presets (``tiny-*``, ``llama-tiny``: :func:`mhe.models.config.cpu_sized`)."""
    return cpu_sized(preset)


class Task:
    """A training objective with its data and evaluation.

    ``setup`` builds tokenizer, data and model (reusing a saved tokenizer when
    resuming); ``collate`` turns item indices into a batch; ``loss`` returns the
    mean loss and the number of scored tokens; ``evaluate`` returns metrics that
    include ``metric``; ``final`` returns the figures for ``results.json``.
    """

    name: str = ""
    metric: str = ""
    higher_is_better: bool = True
    summary: str = ""                 # one line for the command line's help
    command: str = "train"            # the mhe command that trains it
    options: type = NoTaskOptions     # the class of ``data.task_options``
    static_shapes: bool = False       # every training batch has one shape (CUDA graphs can replay the step)
    smooths_labels: bool = False      # its loss reads train.label_smoothing (translation's does)

    # ------------------------------------------------------------------ defaults
    @classmethod
    def default_config(cls, preset: str, *, attention: str | AttentionSpec = "mha", dataset: str = "") -> RunConfig:
        """The task's default run for a model preset, attention kind and data set."""
        data = cls.default_data(preset, dataset)
        if data.task_options is None:
            data.task_options = cls.options()
        model = get_preset(preset).replace(attention=attention, **cls.default_model(preset))
        return RunConfig(task=cls.name, preset=preset, model=model, train=cls.default_train(preset, dataset),
                         data=data)

    @classmethod
    def default_train(cls, preset: str, dataset: str) -> TrainConfig:
        return TrainConfig(**TINY_TRAIN) if is_tiny(preset) else TrainConfig()

    @classmethod
    def default_model(cls, preset: str) -> dict:
        """Model settings that differ from the preset's for this task."""
        return {}

    @classmethod
    def default_data(cls, preset: str, dataset: str) -> DataConfig:
        return DataConfig(dataset=dataset)

    def check(self, cfg: RunConfig) -> None:
        """Check every setting, path and data source of ``cfg`` that the task will use, before
        any folder is created (one-line errors); reads no data."""

    def check_label_smoothing(self, cfg: RunConfig) -> None:
        """Refuse a non-zero ``train.label_smoothing`` for a task whose loss does not read it:
        the run would train without it, silently."""
        if cfg.train.label_smoothing and not self.smooths_labels:
            raise MheError(f"train.label_smoothing={cfg.train.label_smoothing} has no effect on the {self.name} task "
                           "(only mt smooths its loss); leave it at 0")

    def setup(self, cfg: RunConfig, out: Path, dist: Dist) -> torch.nn.Module:
        raise NotImplementedError

    def setup_inference(self, cfg: RunConfig, run_dir: Path, dist: Dist) -> torch.nn.Module:
        """The model (untrained) and what inference needs, for a saved run: tasks whose
        inference needs no corpus (translation) read only the run folder; the others set up
        as for training."""
        return self.setup(cfg, run_dir, dist)

    def n_train_items(self) -> int:
        raise NotImplementedError

    def collate(self, indices: list[int]) -> dict:
        raise NotImplementedError

    def loss(self, model, batch: dict, *, chunked_loss: bool | None = None) -> tuple[torch.Tensor, int]:
        """The loss of ``batch`` through ``model`` and the tokens it scored. ``chunked_loss``: how
        a model with a chunked output-layer loss scores it (None: by precision;
        :func:`~mhe.models.losses.chunked_loss_wanted`), the step's choice."""
        raise NotImplementedError

    def evaluate(self, model) -> dict:
        raise NotImplementedError

    def final(self, model) -> dict:
        return self.evaluate(model)

    @staticmethod
    def to(batch: dict, device) -> dict:
        import torch

        return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
