"""ReCoRD (Zhang et al. 2018; SuperGLUE) in its official JSONL format.

Each line is a passage with its entities and its queries::

    {"idx": 0, "source": "...",
     "passage": {"text": "...", "entities": [{"start": 0, "end": 4}, ...]},
     "qas": [{"idx": 0, "query": "... @placeholder ...",
              "answers": [{"start": 0, "end": 4, "text": "..."}]}]}

Entity and answer spans are character offsets with an inclusive ``end``. The candidates of
a query are the passage's distinct entity texts, in order of first mention; the passage's
``@highlight`` markers become "- " in the model's input (as the SuperGLUE baselines do).
The data is not in the offline collection (its files are 15 to 136 MB; MANIFEST.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mhe.data.paths import data_root, find_file, open_text
from mhe.errors import MheError, one_of

PLACEHOLDER = "@placeholder"
FILES = {"train": "superglue/ReCoRD/train.jsonl", "dev": "superglue/ReCoRD/val.jsonl",
         "test": "superglue/ReCoRD/test.jsonl"}


@dataclass
class RecordQuery:
    """One cloze query: the passage, the query with ``@placeholder``, the candidate entity
    texts and the gold answer texts (empty for the unlabelled test split)."""

    uid: str
    passage: str
    query: str
    candidates: list = field(default_factory=list)
    answers: list = field(default_factory=list)

    def filled(self, entity: str) -> str:
        """The query with ``entity`` in place of ``@placeholder``."""
        return self.query.replace(PLACEHOLDER, entity)


def record_path(split: str, data_dir=None) -> Path:
    if split not in FILES:
        raise one_of("ReCoRD split", split, FILES)
    try:
        return find_file(FILES[split], data_root(data_dir))
    except MheError as e:
        raise MheError(f"ReCoRD {split} data is not offline here (not in the shared data; 15-136 MB files): "
                       f"put the official {FILES[split]} under --data-dir") from e


def read_record(split: str = "dev", *, data_dir=None, path=None, limit: int | None = None) -> list[RecordQuery]:
    """The queries of a ReCoRD split (or of the JSONL file ``path``)."""
    path = Path(path) if path else record_path(split, data_dir)
    out: list[RecordQuery] = []
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                out.extend(parse_record(line, path, n))
            if limit and len(out) >= limit:
                return out[:limit]
    return out


def parse_record(line: str, path="<record>", n: int = 1) -> list[RecordQuery]:
    """One official JSONL line -> its queries."""
    try:
        rec = json.loads(line)
        passage = rec["passage"]
        text = passage["text"]
        spans = [(e["start"], e["end"]) for e in passage["entities"]]
        qas = rec["qas"]
    except (ValueError, KeyError, TypeError) as e:
        raise MheError(f"{path}: record {n}: not an official ReCoRD record ({type(e).__name__}: {e})") from e
    candidates: list[str] = []
    for start, end in spans:
        if not 0 <= start <= end < len(text):
            raise MheError(f"{path}: record {n}: entity span {start}..{end} outside the passage")
        ent = text[start:end + 1]  # inclusive end
        if ent not in candidates:
            candidates.append(ent)
    shown = text.replace("@highlight\n", "- ")
    out = []
    for q in qas:
        query = q.get("query", "")
        if PLACEHOLDER not in query:
            raise MheError(f"{path}: record {n}: query {q.get('idx')!r} has no {PLACEHOLDER}")
        answers = [a["text"] for a in q.get("answers", [])]
        out.append(RecordQuery(str(q.get("idx", len(out))), shown, query, list(candidates), answers))
    return out
