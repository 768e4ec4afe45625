"""``offline-english``: every English text of the offline data folder that no comparison of
ours evaluates on, as one pre-training corpus (the paper pre-trains on Wikipedia + BookCorpus,
Appendix B, which cannot be had offline).

Training text, in this order (one line per paragraph or sentence, as each source stores it):

* WikiText-2 train, Penn Treebank train, Multi30k English train (the training sides of our
  language-modelling and translation comparisons; their valid/test splits stay out);
* GLUE QNLI dev and test (questions and sentences), SuperGLUE BoolQ val and test (passages
  and questions), MultiRC passages (train, val, test), SQuAD v1.1 dev contexts and
  newstest2014's English side (SGML stripped): tasks we never fine-tune or evaluate on.

Never included: the text of the tasks we fine-tune and evaluate on (RTE, MRPC, CoLA, SST-2,
STS-B, WNLI, CB, COPA, WiC, AX-b, AX-g): no such file is a source, and a source line equal to
one of their texts is dropped (STS-B's image captions recur in Multi30k, a few SST-2 phrases in
PTB). Repeated lines (whitespace-normalised) are kept once, and a line equal to one of
WikiText-2's valid or test lines is dropped. Valid and test are
WikiText-2's own, so perplexities stay comparable with the ``wikitext-2`` comparisons.

Measured on the stored files (words: whitespace tokens after deduplication), see
docs/recipes.md, "The offline English corpus".
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Callable, Iterator

from mhe.data.bench_readers import TAG
from mhe.data.benchmarks import read_examples
from mhe.data.paths import data_root, find_file, iter_lines, open_text, record_shape
from mhe.data.parallel_text import parallel_corpus, read_sgml
from mhe.errors import MheError

NAME = "offline-english"
HELD_OUT = "wikitext-2"  # valid and test
# the benchmark tasks our comparisons fine-tune and evaluate on, and their splits
EVALUATED = {**{t: ("train", "dev") for t in ("rte", "mrpc", "cola", "sst2", "stsb", "wnli", "cb", "copa", "wic")},
             "ax-b": ("test",), "ax-g": ("test",)}


def _corpus(name: str, root: Path) -> Iterator[str]:
    from mhe.data.corpora import read_lines  # corpora dispatches here: imported when used

    yield from read_lines(name, "train", data_dir=root)


def _multi30k(root: Path) -> Iterator[str]:
    yield from iter_lines(find_file(parallel_corpus("multi30k").files["train"].format(lang="en"), root))


def _tsv(root: Path, relpath: str, columns: tuple) -> Iterator[str]:
    """The named columns of a GLUE TSV file (labelled or not), row by row."""
    path = find_file(relpath, root)
    rows = csv.reader(iter_lines(path), delimiter="\t", quoting=csv.QUOTE_NONE)
    header = [h.lstrip("\ufeff") for h in next(rows, [])]
    missing = [c for c in columns if c not in header]
    if missing:
        raise MheError(f"{path}: header lacks column {missing[0]!r} (has {', '.join(header) or 'nothing'})")
    idx = [header.index(c) for c in columns]
    for n, row in enumerate(rows, 2):
        if len(row) < len(header):
            raise MheError(f"{path}: line {n}: {len(row)} fields, expected {len(header)}")
        yield from (row[i] for i in idx)


def _jsonl(root: Path, relpath: str, texts: Callable[[dict], list]) -> Iterator[str]:
    """``texts(record)`` of every record of a SuperGLUE JSONL file."""
    path = find_file(relpath, root)
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise MheError(f"{path}: record {n}: not valid JSON") from e
            with record_shape(path, f"record {n}"):
                out = texts(rec)
                if not all(isinstance(t, str) for t in out):
                    raise TypeError("a text field is not a string")
            yield from out


def _qnli(root: Path) -> Iterator[str]:
    for split in ("dev", "test"):
        yield from _tsv(root, f"glue/QNLI/{split}.tsv", ("question", "sentence"))


def _boolq(root: Path) -> Iterator[str]:
    for split in ("val", "test"):
        yield from _jsonl(root, f"superglue/BoolQ/{split}.jsonl", lambda r: [r["passage"], r["question"]])


def _multirc(root: Path) -> Iterator[str]:
    for split in ("train", "val", "test"):
        yield from _jsonl(root, f"superglue/MultiRC/{split}.jsonl", lambda r: [TAG.sub(" ", r["passage"]["text"])])


def _squad(root: Path) -> Iterator[str]:
    yield from (ex.text_b for ex in read_examples("squad", "dev", data_dir=root))


def _newstest(root: Path) -> Iterator[str]:
    yield from read_sgml(find_file(parallel_corpus("wmt14").files["test"].format(lang="en", role="ref"), root))


# source name -> its lines, in the corpus's order
SOURCES: dict[str, Callable[[Path], Iterator[str]]] = {
    "wikitext-2 train": lambda root: _corpus("wikitext-2", root),
    "ptb train": lambda root: _corpus("ptb", root),
    "multi30k en train": _multi30k,
    "qnli dev+test": _qnli,
    "boolq val+test": _boolq,
    "multirc passages": _multirc,
    "squad v1.1 dev contexts": _squad,
    "newstest2014 en": _newstest,
}


def _key(line: str) -> str:
    return " ".join(line.split())


def _held_out(root: Path, evaluated: dict) -> set[str]:
    """WikiText-2's valid and test lines and every text of the ``evaluated`` tasks' splits."""
    from mhe.data.corpora import read_lines

    out = {_key(t) for split in ("valid", "test") for t in read_lines(HELD_OUT, split, data_dir=root)}
    for task, splits in evaluated.items():
        for split in splits:
            for ex in read_examples(task, split, data_dir=root):
                out.update(_key(t) for t in (ex.text_a, ex.text_b, *(ex.choices or ())) if t)
    return out


def train_by_source(data_dir=None, *, limit: int | None = None,
                    evaluated: dict | None = None) -> Iterator[tuple[str, str]]:
    """(source, line) of the training text: whitespace-normalised, each line once, none equal
    to a valid/test line or a text of the ``evaluated`` tasks (default :data:`EVALUATED`);
    stops after ``limit`` lines (the later sources are then not read)."""
    root = data_root(data_dir)
    held, seen, n = _held_out(root, EVALUATED if evaluated is None else evaluated), set(), 0
    for name, lines in SOURCES.items():
        for line in lines(root):
            key = _key(line)
            if not key or key in seen or key in held:
                continue
            seen.add(key)
            yield name, key
            n += 1
            if limit and n >= limit:
                return


def read_offline_english(split: str, *, data_dir=None, limit: int | None = None) -> list[str]:
    """The split's lines: the composed training text, or WikiText-2's valid / test."""
    if split != "train":
        from mhe.data.corpora import read_lines

        return read_lines(HELD_OUT, split, data_dir=data_dir, limit=limit)
    return [line for _, line in train_by_source(data_dir, limit=limit)]


def source_counts(data_dir=None) -> dict[str, dict[str, int]]:
    """Lines and words (whitespace tokens) each source adds to the training text."""
    out = {name: {"lines": 0, "words": 0} for name in SOURCES}
    for name, line in train_by_source(data_dir):
        out[name]["lines"] += 1
        out[name]["words"] += len(line.split())
    return out
