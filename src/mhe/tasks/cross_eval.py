"""Perplexity of a trained language model on another corpus, with the run's own tokenizer
(``mhe eval --data CORPUS``): the paper pre-trains once and reports WikiText-103 and Penn
Treebank (section 4.5: sliding window, stride 256)."""

from __future__ import annotations

import copy

from mhe.errors import MheError
from mhe.tasks.text import corpus_lines, token_stream


def corpus_perplexity(task, model, cfg, dataset: str, split: str = "test") -> dict:
    """Per-token (and, for sub-word tokenizers, per-word) perplexity of ``model`` on ``dataset``.

    Args:
        task: the run's :class:`~mhe.tasks.lm.CausalLMTask`, set up (it holds the tokenizer).
        model: the run's model in eval mode.
        cfg: the run's configuration (its data folder and line limit are kept).
        dataset: a corpus name (``ptb``, ``wikitext-2``, ``wikitext-103``).
        split: ``valid`` or ``test``.
    """
    if cfg.task != "lm":
        raise MheError(f"--data scores language-modelling runs; this one is a {cfg.task!r} run")
    other = copy.deepcopy(cfg)
    other.data.dataset = dataset
    lines = corpus_lines(other, split)
    stride = task.stride()
    res = task._ppl(model, token_stream(task.tok, lines), lines, stride, progress=cfg.train.progress)
    return {"dataset": dataset, "split": split, "stride": stride, "trained_on": cfg.data.dataset, **res}
