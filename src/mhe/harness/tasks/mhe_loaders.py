"""Offline data for the harness tasks in this folder (``custom_dataset`` of each YAML file).

lm-evaluation-harness imports this file by its path when it reads a task, and calls one of the
functions below with the task's metadata (``data_dir`` among it, when given) instead of
downloading a data set. Each reads the project's own copies under the data folder
(``data_dir``, else ``$MHE_DATA``, else ``../shared/data``: :func:`mhe.data.paths.data_root`)
and returns a ``datasets.DatasetDict`` of ready fields, so that the YAML files only name them.
"""

from __future__ import annotations

import json
import re

from mhe.data.paths import data_root, find_file, iter_lines

PTB_LINES_PER_DOCUMENT = 50
"""PTB has no documents: the harness scores blocks of this many consecutive sentences (about
1,100 words), each from its own start, so that ``--limit`` can take a few."""

ARTICLE = re.compile(r"^= [^=].* =$")
"""A WikiText article's title line (sections have two or more ``=`` on each side)."""


def _lines(relpath: str, data_dir) -> list[str]:
    """The file's lines, stripped, blank ones dropped (as ``mhe eval`` reads a corpus)."""
    path = find_file(relpath, data_root(data_dir))
    return [s for s in (line.strip() for line in iter_lines(path)) if s]


def _dataset(splits: dict[str, list[dict]]):
    from datasets import Dataset, DatasetDict

    return DatasetDict({name: Dataset.from_list(rows) for name, rows in splits.items()})


def wikitext_articles(lines: list[str]) -> list[str]:
    """The lines grouped into articles (a title line starts one), each article's lines joined
    by newlines."""
    articles: list[list[str]] = []
    for line in lines:
        if ARTICLE.match(line) or not articles:
            articles.append([])
        articles[-1].append(line)
    return ["\n".join(a) for a in articles]


def wikitext2(data_dir=None, **_metadata):
    """WikiText-2 (the tokenized ``wiki.*.tokens`` files): one document per article."""
    return _dataset({split: [{"page": page} for page in wikitext_articles(_lines(f"wikitext-2/wiki.{name}.tokens",
                                                                                  data_dir))]
                     for split, name in (("validation", "valid"), ("test", "test"))})


def ptb_documents(lines: list[str]) -> list[str]:
    """Blocks of :data:`PTB_LINES_PER_DOCUMENT` sentences, joined by newlines."""
    n = PTB_LINES_PER_DOCUMENT
    return ["\n".join(lines[i:i + n]) for i in range(0, len(lines), n)]


def ptb(data_dir=None, **_metadata):
    """Penn Treebank (Mikolov's ``ptb.*.txt``): blocks of sentences (:func:`ptb_documents`)."""
    return _dataset({split: [{"page": page} for page in ptb_documents(_lines(f"ptb/ptb.{name}.txt", data_dir))]
                     for split, name in (("validation", "valid"), ("test", "test"))})


def _records(task: str, data_dir) -> list[dict]:
    """The labelled SuperGLUE validation records of ``task`` (``superglue/TASK/val.jsonl``)."""
    return [json.loads(line) for line in _lines(f"superglue/{task}/val.jsonl", data_dir)]


def _sentence(text: str) -> str:
    return text.strip().rstrip(".!?")


RTE_LABELS = ("entailment", "not_entailment")
CB_LABELS = ("entailment", "contradiction", "neutral")


def rte(data_dir=None, **_metadata):
    """RTE: does the premise entail the hypothesis? Answers ``True`` / ``False``."""
    rows = [{"query": f"{r['premise']}\nQuestion: {r['hypothesis']} True or False?\nAnswer:",
             "choices": [" True", " False"], "gold": RTE_LABELS.index(r["label"])} for r in _records("RTE", data_dir)]
    return _dataset({"validation": rows})


def cb(data_dir=None, **_metadata):
    """CommitmentBank: entailment, contradiction or neither. Answers ``True`` / ``False`` / ``Neither``."""
    rows = [{"query": f"{r['premise']}\nQuestion: {_sentence(r['hypothesis'])}. True, False or Neither?\nAnswer:",
             "choices": [" True", " False", " Neither"], "gold": CB_LABELS.index(r["label"])}
            for r in _records("CB", data_dir)]
    return _dataset({"validation": rows})


def copa(data_dir=None, **_metadata):
    """COPA: the more plausible cause or effect, as a continuation of the premise joined by
    ``because`` (cause) or ``so`` (effect)."""
    rows = []
    for r in _records("COPA", data_dir):
        joiner = {"cause": "because", "effect": "so"}[r["question"]]
        rows.append({"query": f"{_sentence(r['premise'])} {joiner}",
                     "choices": [" " + c[0].lower() + c[1:] for c in (r["choice1"], r["choice2"])],
                     "gold": int(r["label"])})
    return _dataset({"validation": rows})


def wic(data_dir=None, **_metadata):
    """WiC: is the word used with the same meaning in both sentences? Answers ``no`` / ``yes``."""
    rows = [{"query": f"Sentence 1: {r['sentence1']}\nSentence 2: {r['sentence2']}\nQuestion: Is the word "
                      f"'{r['word']}' used with the same meaning in the two sentences above?\nAnswer:",
             "choices": [" no", " yes"], "gold": int(bool(r["label"]))} for r in _records("WiC", data_dir)]
    return _dataset({"validation": rows})
