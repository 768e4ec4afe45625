"""What the trainer needs from a task; language modelling, MLM, recall, ... implement it."""

from __future__ import annotations

from pathlib import Path

import torch

from mhe.training.config import RunConfig
from mhe.training.distributed import Dist


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

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, int]:
        raise NotImplementedError

    def evaluate(self, model) -> dict:
        raise NotImplementedError

    def final(self, model) -> dict:
        return self.evaluate(model)

    @staticmethod
    def to(batch: dict, device) -> dict:
        return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
