"""Typed per-task options, the ``data.task_options.*`` settings.

Each task reads its own dataclass (``cfg.data.task_options``); a JSON object
(``--set data.task_options={"beam": 2}``) sets several keys at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mhe.errors import MheError
from mhe.settings import setting, typed_options


@dataclass(frozen=True)
class NoTaskOptions:
    """lm and mlm: every setting lives in ``data.*``."""


@dataclass(frozen=True)
class RecallOptions:
    """Multi-query associative recall (Arora et al. 2023): ``pairs`` key-value pairs
    per sequence, ``queries`` of them asked again; ``data_seed`` fixes the data."""

    n_keys: int = setting(32, gt=0)
    n_values: int = setting(32, gt=0)
    pairs: int = setting(8, gt=0)
    queries: int = setting(8, gt=0)
    train_size: int = setting(20000, gt=0)
    test_size: int = setting(1000, gt=0)
    data_seed: int = setting(1234, ge=0)

    def check(self) -> None:
        """The rules between fields, checked once every ``--set`` item is in."""
        if self.pairs > self.n_keys:
            raise MheError(f"data.task_options.pairs={self.pairs} must be <= data.task_options.n_keys={self.n_keys}")
        if self.queries > self.pairs:
            raise MheError(f"data.task_options.queries={self.queries} must be <= "
                           f"data.task_options.pairs={self.pairs}")


@dataclass(frozen=True)
class TranslationOptions:
    """Translation (paper Table 3): languages, ``max_tokens`` per batch (source + target,
    padding included), beam size and length penalty ``alpha``, validation sentences
    decoded per evaluation, and the test protocol: ``best`` (test BLEU of the best
    validation checkpoint) or ``last5`` (the paper's: each of the last ``last_n`` checkpoints
    decoded with the final beam settings and their BLEU averaged; ``average_weights`` also
    decodes their averaged weights; ``checkpoint_every="epoch"`` saves once per epoch).
    Decoding sorts sources by length and decodes up to ``eval_batch`` sentences together,
    fewer where sentences x beam x (source length rounded up to 32 + the model's max_len)
    would pass ``decode_tokens``; ``decode_dtype="bfloat16"`` decodes a bf16 copy of the
    model (faster on GPU, but the output may differ from fp32's)."""

    src: str = "en"
    tgt: str = "de"
    max_tokens: int = setting(4096, gt=0)
    beam: int = setting(4, gt=0)
    alpha: float = setting(0.6, ge=0)
    eval_sentences: int = setting(500, gt=0)
    protocol: Literal["best", "last5"] = "best"
    eval_batch: int = setting(256, gt=0)
    decode_tokens: int = setting(262144, gt=0)
    decode_dtype: Literal["float32", "bfloat16"] = "float32"
    test_sentences: int = setting(0, ge=0)  # 0: the whole test set
    last_n: int = setting(5, gt=0)
    average_weights: bool = False
    checkpoint_every: Literal["", "epoch"] = ""


@dataclass(frozen=True)
class FinetuneOptions:
    """Fine-tuning: the benchmark ``task`` (rte, ..., squad-v2) and the pre-training run
    ``checkpoint``; splits (offline SQuAD has no train file, so tests train on a labelled
    part of dev starting at ``dev_offset``), limits, and SQuAD's ``doc_stride`` and
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


TASK_OPTIONS: dict[str, type] = {"lm": NoTaskOptions, "mlm": NoTaskOptions, "recall": RecallOptions,
                                 "mt": TranslationOptions, "finetune": FinetuneOptions}


def task_options(task: str, value: object = None, *, key: str = "data.task_options"):
    """``value`` (None, a dict or the options themselves) as ``task``'s typed options."""
    return typed_options(TASK_OPTIONS.get(task, NoTaskOptions), value, key, f"task {task!r}")
