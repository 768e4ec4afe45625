"""Parallel corpora for translation: Multi30k and WMT-14 (paper section 4.2, Table 3).

Local files in their distributed formats: one sentence per line
(``{split}.{lang}``, gzip/xz or not) or WMT's SGML test sets (``<seg id=..>``).
The optional ``datasets`` package loads the hub's ``wmt/wmt14`` instead.

Empty lines: training drops every pair with an empty side; evaluation keeps
every line, so hypotheses stay aligned with the reference file, and an empty
source line is translated to an empty line.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

from mhe.data.paths import data_root, find_file, hub_split, iter_lines, read_text
from mhe.errors import MheError, one_of

SEG = re.compile(r"<seg[^>]*>(.*?)</seg>", re.IGNORECASE)


@dataclass(frozen=True)
class ParallelCorpus:
    name: str
    langs: tuple
    files: dict  # split -> pattern with {lang} (and {src}/{tgt} for SGML)
    hub: tuple


PARALLEL = {
    "multi30k": ParallelCorpus("multi30k", ("en", "de"), {
        "train": "multi30k/train.{lang}", "valid": "multi30k/val.{lang}", "test": "multi30k/test_2016_flickr.{lang}",
        "test2017": "multi30k/test_2017_flickr.{lang}", "test2018": "multi30k/test_2018_flickr.{lang}"}, ()),
    "wmt14": ParallelCorpus("wmt14", ("en", "de"), {
        "train": "wmt14/train.{lang}", "valid": "wmt14/newstest2013.{lang}",
        "test": "wmt14/newstest2014-deen-{role}.{lang}.sgm"}, ("wmt/wmt14", "de-en")),
}


def parallel_corpus(name: str) -> ParallelCorpus:
    if name not in PARALLEL:
        raise one_of("translation dataset", name, PARALLEL)
    return PARALLEL[name]


def read_sgml(path: Path) -> list[str]:
    """The text of every <seg> of a WMT SGML file, in order, entities decoded."""
    return [html.unescape(m.group(1).strip()) for m in SEG.finditer(read_text(path))]


def _read(path: Path) -> list[str]:
    """The file's sentences; a file without one non-blank line is an error (an empty split)."""
    lines = read_sgml(path) if ".sgm" in path.name else [line.rstrip("\n").strip() for line in iter_lines(path)]
    if not any(lines):
        what = "no <seg> with text" if ".sgm" in path.name else "no text (empty or blank lines only)"
        raise MheError(f"{path}: {what}")
    return lines


def _request(name: str, split: str, src: str, tgt: str) -> ParallelCorpus:
    """The corpus, after checking the languages and the split asked for."""
    c = parallel_corpus(name)
    for lang in (src, tgt):
        if lang not in c.langs:
            raise one_of(f"language of {name}", lang, c.langs)
    if src == tgt:
        raise MheError(f"source and target language are both {src!r}")
    if split not in c.files:
        raise one_of(f"split of {name}", split, c.files)
    return c


def parallel_files(name: str, split: str, src: str, tgt: str, *, data_dir=None) -> tuple[Path, Path]:
    """The (source, target) files of a split, checked to exist (nothing is read)."""
    c = _request(name, split, src, tgt)
    root = data_root(data_dir)
    pattern = c.files[split]
    return find_file(pattern.format(lang=src, role="src"), root), find_file(pattern.format(lang=tgt, role="ref"), root)


def read_parallel(name: str, split: str, src: str, tgt: str, *, data_dir=None, source: str = "local",
                  drop_empty: bool | None = None, limit: int | None = None) -> tuple[list[str], list[str]]:
    """Aligned (sources, targets). Mismatched line counts name both files and their counts."""
    c = _request(name, split, src, tgt)
    if source == "hub":
        srcs, tgts = _from_hub(c, split, src, tgt)
    else:
        p_src, p_tgt = parallel_files(name, split, src, tgt, data_dir=data_dir)
        srcs, tgts = _read(p_src), _read(p_tgt)
        if len(srcs) != len(tgts):
            raise MheError(f"line counts differ: {p_src} has {len(srcs)}, {p_tgt} has {len(tgts)}")
    if drop_empty is None:
        drop_empty = split == "train"
    if drop_empty:
        pairs = [(s, t) for s, t in zip(srcs, tgts) if s and t]
        srcs, tgts = [p[0] for p in pairs], [p[1] for p in pairs]
        if not pairs:
            raise MheError(f"{name} {split}: no pair has text on both sides ({src}, {tgt})")
    if limit:
        srcs, tgts = srcs[:limit], tgts[:limit]
    return srcs, tgts


def _from_hub(c: ParallelCorpus, split: str, src: str, tgt: str):
    if not c.hub:
        raise MheError(f"{c.name} has no hub source here; put its files under --data-dir")
    ds = hub_split(c.name, c.hub[0], c.hub[1], {"valid": "validation"}.get(split, split),
                   offline=f"put {c.files[split].format(lang=src, role='src')} and its {tgt} side under --data-dir")
    rows = ds["translation"]
    return [r[src].strip() for r in rows], [r[tgt].strip() for r in rows]
