"""The settings half of each task, without torch: its name, metric, command and summary, the
class of its ``data.task_options`` and its default run (:meth:`mhe.training.task.Task.default_config`).
``mhe.tasks.catalogue`` lists them, and ``build_run`` reads only them, so a run's configuration,
and every error in its settings, comes before torch is imported. Each task class
(:mod:`mhe.tasks.lm`, ``mlm``, ``recall``, ``translation``, ``finetune``) subclasses its half.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mhe.data.corpora import CORPORA
from mhe.errors import MheError
from mhe.settings import setting
from mhe.tasks.translation_config import TranslationOptions, translation_train
from mhe.training.config import DataConfig, TrainConfig
from mhe.training.task import Task, is_tiny


class TextSettings(Task):
    """Pre-training on a text corpus (lm, mlm): the defaults both share."""

    @classmethod
    def default_train(cls, preset, dataset):
        train = super().default_train(preset, dataset)
        if is_tiny(preset):
            train.batch_size = 16  # 16 x 64 tokens a step: a 10k-word softmax stays cheap on two CPU cores
        return train

    @classmethod
    def default_model(cls, preset):
        return {"max_len": 64} if is_tiny(preset) else {}


@dataclass(frozen=True)
class LMOptions:
    """``data.task_options`` of lm: ``also_test`` names further corpora whose test split the
    finished model is scored on as well, with the run's tokenizer and the same sliding window
    (the paper pre-trains once and reports WikiText-103 and PTB, section 4.5). Each adds
    ``CORPUS_perplexity`` (and, for a sub-word tokenizer, ``CORPUS_word_perplexity``) to
    ``results.json``; the score stays the training corpus's own test split."""

    also_test: list[str] = field(default_factory=list)

    def check(self) -> None:
        for name in self.also_test:
            if name not in CORPORA:
                raise MheError(f"data.task_options.also_test: unknown corpus {name!r}; valid: {', '.join(CORPORA)}")


class LMSettings(TextSettings):
    name = "lm"
    metric = "perplexity"
    higher_is_better = False
    summary = "causal language modelling (decoder presets), test perplexity"
    static_shapes = True  # batch_size x seq_len blocks, full batches only (an adaptive softmax: not; setup)
    options = LMOptions

    @classmethod
    def default_data(cls, preset, dataset):
        # the tokenised WikiText-2 is a word-level corpus (33k words)
        word = is_tiny(preset) and dataset == "wikitext-2"
        return DataConfig(dataset=dataset, tokenizer="word" if word else "")


class MLMSettings(TextSettings):
    name = "mlm"
    metric = "mlm_accuracy"
    higher_is_better = True
    summary = "masked language modelling (encoder presets), validation accuracy"
    static_shapes = True  # packed blocks; a compiled run scores a fixed number of masked rows (self.static)


RECALL_TRAIN = dict(steps=1000, batch_size=64, lr=3e-3, warmup_steps=50, schedule="cosine", log_every=20,
                    save_every=250, weight_decay=0.0, betas=(0.9, 0.98))
RECALL_MODEL = dict(d_model=64, d_ff=256, n_layers=2, n_heads=4, dropout=0.0, attn_dropout=0.0)


@dataclass(frozen=True)
class RecallOptions:
    """``data.task_options`` of recall: ``pairs`` key-value pairs per sequence, ``queries`` of
    them asked again, from ``n_keys`` keys and ``n_values`` values; ``data_seed`` fixes the data.
    ``seq_len`` 0 packs the queries right after the pairs (``2 x (pairs + queries)`` tokens);
    ``seq_len`` N lays each sequence out as Zoology's MQAR does (:func:`mhe.tasks.recall.make_zoology_recall`):
    N tokens, the queries spread over the rest at power-law distances, the gaps padding."""

    n_keys: int = setting(32, gt=0)
    n_values: int = setting(32, gt=0)
    pairs: int = setting(8, gt=0)
    queries: int = setting(8, gt=0)
    train_size: int = setting(20000, gt=0)
    test_size: int = setting(1000, gt=0)
    data_seed: int = setting(1234, ge=0)
    seq_len: int = setting(0, ge=0)

    def check(self) -> None:
        """The rules between fields, checked once every ``--set`` item is in."""
        if self.pairs > self.n_keys:
            raise MheError(f"data.task_options.pairs={self.pairs} must be <= data.task_options.n_keys={self.n_keys}")
        if self.queries > self.pairs:
            raise MheError(f"data.task_options.queries={self.queries} must be <= "
                           f"data.task_options.pairs={self.pairs}")
        if self.seq_len and self.seq_len < 2 * (self.pairs + self.queries):
            raise MheError(f"data.task_options.seq_len={self.seq_len} must be 0 (packed) or at least "
                           f"2 x (pairs + queries) = {2 * (self.pairs + self.queries)}")

    def length(self) -> int:
        """Tokens per sequence."""
        return self.seq_len or 2 * (self.pairs + self.queries)


class RecallSettings(Task):
    name = "recall"
    metric = "accuracy"
    higher_is_better = True
    summary = "multi-query associative recall (generated, no download)"
    options = RecallOptions

    @classmethod
    def default_train(cls, preset, dataset):
        return TrainConfig(**RECALL_TRAIN)

    @classmethod
    def default_model(cls, preset):
        return dict(RECALL_MODEL) if is_tiny(preset) else {}


class TranslationSettings(Task):
    name = "mt"
    metric = "bleu"
    higher_is_better = True
    summary = "translation with the encoder-decoder, test BLEU"
    command = "train-mt"
    options = TranslationOptions
    smooths_labels = True

    @classmethod
    def default_train(cls, preset, dataset):
        return translation_train(preset)
