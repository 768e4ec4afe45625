"""Every task's name, the ``mhe`` command that trains it and its one-line summary, without torch:
``mhe train --help`` lists them before any task is imported. Each task class takes its
``summary`` and ``command`` from here; :mod:`mhe.tasks.registry` checks that the two name the
same tasks."""

from __future__ import annotations

from typing import NamedTuple


class TaskEntry(NamedTuple):
    command: str  # the mhe command that trains it
    summary: str  # one line for the command line's help


CATALOGUE: dict[str, TaskEntry] = {
    "lm": TaskEntry("train", "causal language modelling (decoder presets), test perplexity"),
    "mlm": TaskEntry("train", "masked language modelling (encoder presets), validation accuracy"),
    "recall": TaskEntry("train", "multi-query associative recall (generated, no download)"),
    "mt": TaskEntry("train-mt", "translation with the encoder-decoder, test BLEU"),
    "finetune": TaskEntry("finetune", "fine-tuning a pre-training run on GLUE, SuperGLUE or SQuAD"),
}


def train_tasks() -> list[str]:
    """The tasks ``mhe train`` runs (the others have their own command)."""
    return [name for name, entry in CATALOGUE.items() if entry.command == "train"]
