"""Shared by the text tasks: tokenizer training/reuse and token streams."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from mhe.data.corpora import SPLITS, check_corpus, corpus, corpus_names, read_lines
from mhe.errors import MheError
from mhe.data.tokenize import cached_tokenizer, load_tokenizer, save_tokenizer, special_id
from mhe.output_paths import shown_path
from mhe.progress import bar, note
from mhe.runtime import cache_root
from mhe.tasks.vocab import resolve_tokenizer
from mhe.training.run_report import phase


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
    kind and size the preset's convention and ``data.*`` choose (:mod:`mhe.tasks.vocab`), or take
    the one an earlier run trained from the same lines and settings (:func:`mhe.data.tokenize.cached_tokenizer`,
    in ``MHE_CACHE_DIR``). Under DDP the main process trains it and the others load it. Timed as
    the run's ``tokenizer`` phase (:mod:`mhe.training.run_report`).

    ``word_level_corpus``: whether the corpus is already word-level (keeps its words);
    ``None`` looks it up in the corpus table (``cfg.data.dataset``)."""
    with phase("tokenizer"):
        if dist is not None and dist.world > 1:
            if dist.main and not (out / "tokenizer.json").is_file():
                tokenizer_for(cfg, out, train_lines, task=task, word_level_corpus=word_level_corpus)
            dist.barrier()
        if (out / "tokenizer.json").is_file():
            return load_tokenizer(out)
        if word_level_corpus is None:
            word_level_corpus = corpus(cfg.data.dataset).word_level
        choice = resolve_tokenizer(cfg, task, word_level_corpus=word_level_corpus)
        tok = cached_tokenizer(choice.kind, train_lines, choice.vocab_size, cache=cache_root(),
                               progress=cfg.train.progress)
        out.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tok, out)
        return tok


TOKENIZE_CHUNK = 10_000  # lines encoded per call (and per step of the progress bar)
CACHED_FROM_LINES = 20_000  # token streams of this many lines or more are kept in the cache folder


def token_stream(tok, lines: list[str], *, progress: bool = False, desc: str = "tokenizing") -> torch.Tensor:
    """Every line's tokens followed by [EOS], as one 1-D stream; ``progress``: count the lines
    on a bar (standard error). A stream of ``CACHED_FROM_LINES`` lines or more (a training split)
    is kept in ``MHE_CACHE_DIR/tokens``, keyed by the SHA-256 of the tokenizer and the lines, and a
    later run of the same corpus and tokenizer reads it back instead of tokenizing again."""
    path = _stream_path(tok, lines) if len(lines) >= CACHED_FROM_LINES else None
    if path is not None and path.is_file():
        ids = np.fromfile(path, dtype=np.int32)
        note(f"{desc}: {len(lines):,} lines, {ids.size:,} tokens read back from {shown_path(path)}", enabled=progress)
        return torch.from_numpy(ids.astype(np.int64))
    eos = special_id(tok, "[EOS]")
    ids: list[int] = []
    with bar(len(lines), desc=desc, unit="line", enabled=progress) as shown:
        for k in range(0, len(lines), TOKENIZE_CHUNK):
            chunk = lines[k:k + TOKENIZE_CHUNK]
            for enc in tok.encode_batch(chunk, add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eos)
            shown.update(len(chunk))
    stream = torch.tensor(ids, dtype=torch.long)
    if path is not None:
        _write_stream(path, stream)
    return stream


def _stream_path(tok, lines: list[str]) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    h = hashlib.sha256(tok.to_str().encode())
    h.update(f"|{len(lines)}\n".encode())
    for line in lines:
        h.update(line.encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return root / "tokens" / f"{h.hexdigest()[:32]}.int32"


def _write_stream(path: Path, stream: torch.Tensor) -> None:
    """``stream`` as raw int32 at ``path``, atomically (a temporary name per process, then renamed);
    skipped where the folder cannot be written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        stream.to(torch.int32).numpy().tofile(tmp)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def is_word_level(tok) -> bool:
    return json.loads(tok.to_str())["model"]["type"] == "WordLevel"


def pad_rows(rows: list[list[int]], value: int) -> torch.Tensor:
    """Right-pad lists of ids to one length: ``[len(rows), longest]``."""
    n = max(len(r) for r in rows)
    return torch.tensor([r + [value] * (n - len(r)) for r in rows], dtype=torch.long)
