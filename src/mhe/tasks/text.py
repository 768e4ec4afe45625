"""Shared by the text tasks: tokenizer training/reuse and token streams."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from mhe.data.corpora import SPLITS, check_corpus, corpus, corpus_names, read_lines
from mhe.errors import MheError
from mhe.data.tokenize import load_tokenizer, save_tokenizer, special_id, train_tokenizer
from mhe.progress import bar
from mhe.tasks.vocab import resolve_tokenizer


def check_text_data(cfg, what: str, splits=SPLITS) -> None:
    """The corpus of a pre-training run named and its files there (nothing read), and the run
    ``train.init_from`` starts from (continued pre-training)."""
    if not cfg.data.dataset:
        raise MheError(f"{what} needs --data ({corpus_names()})")
    check_corpus(cfg.data.dataset, splits, data_dir=cfg.data.data_dir or None, source=cfg.data.source)
    if cfg.train.init_from:
        from mhe.tasks.init_from import source_checkpoint  # it reads tokenizers through this module

        source_checkpoint(cfg.train.init_from)


def corpus_lines(cfg, split: str) -> list[str]:
    d = cfg.data
    return read_lines(d.dataset, split, data_dir=d.data_dir or None, source=d.source,
                      limit=d.limit_lines or None)


def tokenizer_for(cfg, out: Path, train_lines: list[str], *, task: str, dist=None,
                  word_level_corpus: bool | None = None):
    """Reuse ``out/tokenizer.json`` when it exists (resume), else train and save one of the
    kind and size the preset's convention and ``data.*`` choose (:mod:`mhe.tasks.vocab`).
    Under DDP the main process trains it and the others load it.

    ``word_level_corpus``: whether the corpus is already word-level (keeps its words);
    ``None`` looks it up in the corpus table (``cfg.data.dataset``)."""
    if dist is not None and dist.world > 1:
        if dist.main and not (out / "tokenizer.json").is_file():
            tokenizer_for(cfg, out, train_lines, task=task, word_level_corpus=word_level_corpus)
        dist.barrier()
    if (out / "tokenizer.json").is_file():
        return load_tokenizer(out)
    if word_level_corpus is None:
        word_level_corpus = corpus(cfg.data.dataset).word_level
    choice = resolve_tokenizer(cfg, task, word_level_corpus=word_level_corpus)
    tok = train_tokenizer(choice.kind, train_lines, choice.vocab_size, progress=cfg.train.progress)
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out)
    return tok


TOKENIZE_CHUNK = 10_000  # lines encoded per call (and per step of the progress bar)


def token_stream(tok, lines: list[str], *, progress: bool = False, desc: str = "tokenizing") -> torch.Tensor:
    """Every line's tokens followed by [EOS], as one 1-D stream; ``progress``: count the lines
    on a bar (standard error)."""
    eos = special_id(tok, "[EOS]")
    ids: list[int] = []
    with bar(len(lines), desc=desc, unit="line", enabled=progress) as shown:
        for k in range(0, len(lines), TOKENIZE_CHUNK):
            chunk = lines[k:k + TOKENIZE_CHUNK]
            for enc in tok.encode_batch(chunk, add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eos)
            shown.update(len(chunk))
    return torch.tensor(ids, dtype=torch.long)


def is_word_level(tok) -> bool:
    return json.loads(tok.to_str())["model"]["type"] == "WordLevel"


def pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ids to one length: ``[len(rows), longest]``."""
    n = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (n - len(r)) for r in rows], dtype=torch.long)
