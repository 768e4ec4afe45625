"""Plain-text language-modelling corpora: Penn Treebank and WikiText (paper section 4.2), and
``offline-english`` (composed from the other stored English text, :mod:`mhe.data.offline_english`).

Local files are read in their original formats (``ptb.{split}.txt``,
``wiki.{split}.tokens`` / ``wiki.{split}.raw``, gzip/xz or not). When the
optional ``datasets`` package is installed, ``source="hub"`` loads the same
splits from the hub instead.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from mhe.data.paths import data_root, find_file, hub_split, iter_lines
from mhe.errors import MheError, one_of

SPLITS = ("train", "valid", "test")


@dataclass(frozen=True)
class Corpus:
    name: str
    files: dict  # split -> path relative to the data folder (without .gz/.xz)
    hub: tuple  # (dataset, config) on the hub
    word_level: bool  # the convention: word-level vocabulary (PTB) or sub-words
    composed: bool = False  # the training split is built from other files (offline-english)


CORPORA = {
    "ptb": Corpus("ptb", {s: f"ptb/ptb.{s}.txt" for s in SPLITS}, ("ptb_text_only", None), True),
    "wikitext-2": Corpus("wikitext-2", {s: f"wikitext-2/wiki.{s}.tokens" for s in SPLITS},
                         ("Salesforce/wikitext", "wikitext-2-v1"), False),
    "wikitext-103": Corpus("wikitext-103", {s: f"wikitext-103/wiki.{s}.tokens" for s in SPLITS},
                           ("Salesforce/wikitext", "wikitext-103-v1"), False),
    "offline-english": Corpus("offline-english", {s: f"wikitext-2/wiki.{s}.tokens" for s in ("valid", "test")},
                              (), False, composed=True),
}


def corpus(name: str) -> Corpus:
    if name not in CORPORA:
        raise one_of("dataset", name, CORPORA)
    return CORPORA[name]


def corpus_names() -> str:
    """The corpora as the command line lists them: ``ptb, wikitext-2, ...``."""
    return ", ".join(CORPORA)


def check_corpus(name: str, splits=SPLITS, *, data_dir: str | Path | None = None, source: str = "local") -> None:
    """Refuse, before anything is read or written, a corpus that is unknown or whose files
    (``splits``; a composed corpus: its stored splits) are not there, or a hub source without
    the ``datasets`` package."""
    c = corpus(name)
    if source == "hub":
        if not c.hub:
            raise MheError(f"{c.name!r} has no hub source; it is composed of local files (--data-dir)")
        if importlib.util.find_spec("datasets") is None:
            raise MheError(f"loading {c.name!r} from the hub needs the optional 'datasets' package "
                           "(pip install mhe[datasets])")
        return
    if source != "local":
        raise one_of("data source", source, ("local", "hub"))
    root = data_root(data_dir)
    for split in splits:
        if split in c.files:
            find_file(c.files[split], root)


def read_lines(name: str, split: str, *, data_dir: str | Path | None = None, source: str = "local",
               limit: int | None = None) -> list[str]:
    """The split's lines, stripped of the trailing newline; empty lines are dropped.
    A split with no text (empty, or blank lines only) is an error, not an empty list."""
    c = corpus(name)
    if split not in SPLITS:
        raise one_of("split", split, SPLITS)
    if source == "hub":
        return _from_hub(c, split, limit)
    if source != "local":
        raise one_of("data source", source, ("local", "hub"))
    if c.composed:
        from mhe.data.offline_english import read_offline_english  # it reads the corpora above

        return read_offline_english(split, data_dir=data_dir, limit=limit)
    path = find_file(c.files[split], data_root(data_dir))
    lines = []
    for i, line in enumerate(iter_lines(path), 1):
        if "\x00" in line:
            raise MheError(f"{path}:{i}: malformed line (NUL byte) in a text corpus")
        line = line.strip()
        if line:
            lines.append(line)
        if limit and len(lines) >= limit:
            break
    if not lines:
        raise MheError(f"{path}: the {split} split has no text (empty or blank lines only)")
    return lines


def _from_hub(c: Corpus, split: str, limit: int | None) -> list[str]:
    if not c.hub:
        raise MheError(f"{c.name!r} has no hub source; it is composed of local files (--data-dir)")
    ds = hub_split(repr(c.name), c.hub[0], c.hub[1], {"valid": "validation"}.get(split, split),
                   offline=f"put {c.files[split]} under --data-dir")
    key = "sentence" if "sentence" in ds.column_names else "text"
    lines = [t.strip() for t in ds[key] if t.strip()]
    if not lines:
        raise MheError(f"{c.hub[0]} ({c.hub[1]}): the {split} split has no text")
    return lines[:limit] if limit else lines


def word_count(lines: list[str]) -> int:
    """Words for per-word perplexity: whitespace tokens plus one end-of-line per line
    (the <eos> the word-level convention scores)."""
    return sum(len(line.split()) + 1 for line in lines)
