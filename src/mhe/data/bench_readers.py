"""Readers of the official GLUE, SuperGLUE and SQuAD file formats, registered by name in
:data:`READERS` (a task's ``BenchTask.reader``): GLUE's TSV (named columns), CoLA's header-less
TSV, SuperGLUE's JSONL (one parser per record format, :data:`RECORD_PARSERS`) and SQuAD's JSON.

A record with missing fields, of the wrong structure or with a label outside the task's label
set raises an error naming the file and record (the line, for JSONL and TSV).
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path
from typing import Callable

from mhe.data.bench_types import BenchTask, Example
from mhe.data.paths import iter_lines, open_text, read_text, record_shape
from mhe.errors import MheError

TAG = re.compile(r"<[^>]+>")


def _label(t: BenchTask, value, path: Path, where: str):
    if t.kind == "regression":
        try:
            return float(value)
        except (TypeError, ValueError) as e:
            raise MheError(f"{path}: {where}: score {value!r} is not a number") from e
    key = str(value)
    if key not in t.labels:
        raise MheError(f"{path}: {where}: label {value!r} is not one of {', '.join(t.labels)}")
    return t.labels.index(key)


def read_tsv(t: BenchTask, path: Path) -> list[Example]:
    """GLUE's TSV files: a header line, then one example a line (``t.columns`` names the columns)."""
    col_a, col_b, col_label = t.columns
    rows = list(csv.reader(iter_lines(path), delimiter="\t", quoting=csv.QUOTE_NONE))
    if not rows:
        raise MheError(f"{path}: empty file (expected a header line with {col_a!r})")
    header = [h.lstrip("\ufeff") for h in rows[0]]
    need = [c for c in (col_a, col_b, col_label) if c]
    missing = [c for c in need if c not in header]
    if missing:
        raise MheError(f"{path}: header lacks column {missing[0]!r} (has {', '.join(header)})")
    ia, il = header.index(col_a), header.index(col_label)
    ib = header.index(col_b) if col_b else None
    out = []
    for n, row in enumerate(rows[1:], 2):
        if len(row) < len(header):
            raise MheError(f"{path}: line {n}: {len(row)} fields, expected {len(header)}")
        out.append(Example(row[ia], row[ib] if ib is not None else None, _label(t, row[il], path, f"line {n}"),
                           uid=str(n)))
    return out


def read_cola(t: BenchTask, path: Path) -> list[Example]:
    """CoLA's header-less TSV: source, label, original mark, sentence."""
    out = []
    for n, line in enumerate(iter_lines(path), 1):
        parts = line.rstrip("\n").split("\t")
        if len(parts) < 4:
            raise MheError(f"{path}: line {n}: {len(parts)} fields, expected 4 (source, label, mark, sentence)")
        out.append(Example(parts[3], None, _label(t, parts[1], path, f"line {n}"), uid=str(n)))
    return out


def _get(rec, key, path, n):
    if not isinstance(rec, dict):
        raise MheError(f"{path}: record {n}: expected a JSON object with {key!r}, got {type(rec).__name__}")
    if key not in rec:
        raise MheError(f"{path}: record {n}: missing field {key!r}")
    return rec[key]


def _mark(sentence: str, start: int, end: int, sym: str) -> str:
    return sentence[:start] + sym + sentence[start:end] + sym + sentence[end:]


def read_jsonl(t: BenchTask, path: Path) -> list[Example]:
    """SuperGLUE's JSONL files: one official record a line, parsed by ``RECORD_PARSERS[t.reader]``."""
    out = []
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise MheError(f"{path}: record {n}: not valid JSON") from e
                out.extend(parse_record(t, rec, path, n))
    return out


def read_axg(t: BenchTask, path: Path) -> list[Example]:
    """AX-g: NLI records, then paired (:func:`_pair_axg`)."""
    return _pair_axg(read_jsonl(t, path), path)


def _pair_axg(examples: list[Example], path) -> list[Example]:
    """AX-g (Winogender): records 2i and 2i+1 are a minimal pair with the same hypothesis."""
    if len(examples) % 2:
        raise MheError(f"{path}: {len(examples)} records; AX-g holds minimal pairs (an even number)")
    for i in range(0, len(examples), 2):
        a, b = examples[i], examples[i + 1]
        if a.text_b != b.text_b:
            raise MheError(f"{path}: records {a.uid} and {b.uid} should be a minimal pair (same hypothesis)")
        a.group = b.group = f"pair-{i // 2}"
    return examples


def parse_record(t, rec, path, n) -> list[Example]:
    """One official SuperGLUE record -> examples (MultiRC: one per answer); a field of the
    wrong type or structure raises :class:`MheError` naming the file and record."""
    if not isinstance(rec, dict):
        raise MheError(f"{path}: record {n}: expected a JSON object, got a JSON {type(rec).__name__}")
    with record_shape(path, f"record {n}"):
        return RECORD_PARSERS[t.reader](Fields(t, rec, path, n))


class Fields:
    """One record's fields: ``get(key)`` (a missing key names the file and record), ``label(value)``
    (checked against the task's labels) and ``uid`` (the record's ``idx``)."""

    def __init__(self, t: BenchTask, rec: dict, path, n: int) -> None:
        self.t, self.rec, self.path, self.n = t, rec, path, n
        self.uid = str(rec.get("idx", n))

    def get(self, key: str):
        return _get(self.rec, key, self.path, self.n)

    def label(self, value):
        return _label(self.t, value, self.path, f"record {self.n}")


def _boolq(f: Fields) -> list[Example]:
    return [Example(f.get("question"), f.get("passage"), f.label(f.get("label")), uid=f.uid)]


def _nli(f: Fields) -> list[Example]:  # CB, SuperGLUE's RTE, AX-g
    return [Example(f.get("premise"), f.get("hypothesis"), f.label(f.get("label")), uid=f.uid)]


def _axb(f: Fields) -> list[Example]:
    return [Example(f.get("sentence1"), f.get("sentence2"), f.label(f.get("label")), uid=f.uid,
                    group=f.rec.get("logic", ""))]


def _wic(f: Fields) -> list[Example]:
    s1 = _mark(f.get("sentence1"), f.get("start1"), f.get("end1"), "*")
    s2 = _mark(f.get("sentence2"), f.get("start2"), f.get("end2"), "*")
    return [Example(f"{f.get('word')}: {s1}", s2, f.label(f.get("label")), uid=f.uid)]


def _wsc(f: Fields) -> list[Example]:
    target = f.get("target")
    words = f.get("text").split()
    for key, sym in (("span1", "*"), ("span2", "#")):
        i = target[f"{key}_index"]
        k = len(target[f"{key}_text"].split())
        if i + k > len(words):
            raise MheError(f"{f.path}: record {f.n}: {key} index {i} outside the text")
        words[i] = sym + words[i]
        words[i + k - 1] = words[i + k - 1] + sym
    return [Example(" ".join(words), None, f.label(f.get("label")), uid=f.uid)]


def _copa(f: Fields) -> list[Example]:
    if f.get("question") not in COPA_QUESTIONS:
        raise MheError(f"{f.path}: record {f.n}: question {f.get('question')!r} is not one of cause, effect")
    return [Example(f"{f.get('premise')} {COPA_QUESTIONS[f.get('question')]}", None, f.label(f.get("label")),
                    choices=[f.get("choice1"), f.get("choice2")], uid=f.uid)]


def _multirc(f: Fields) -> list[Example]:
    passage = " ".join(TAG.sub(" ", f.get("passage")["text"]).split())
    out = []
    for qi, q in enumerate(f.get("passage")["questions"]):
        for ai, a in enumerate(q["answers"]):
            out.append(Example(passage, f"{q['question']} {a['text']}", f.label(a.get("label")),
                               group=f"{f.uid}-{qi}", uid=f"{f.uid}-{qi}-{ai}"))
    return out


COPA_QUESTIONS = {"cause": "What was the cause?", "effect": "What happened as a result?"}

# SuperGLUE record format -> its parser (one official record -> examples)
RECORD_PARSERS: dict[str, Callable[[Fields], list[Example]]] = {
    "boolq": _boolq, "nli": _nli, "axg": _nli, "axb": _axb, "wic": _wic, "wsc": _wsc, "copa": _copa,
    "multirc": _multirc,
}


def read_squad(t: BenchTask, path: Path) -> list[Example]:
    """SQuAD's JSON: articles of paragraphs of questions, with every gold answer's offset.
    Every question has ``answers`` (v1.1: at least one; v2.0: none exactly when
    ``is_impossible``); a question that breaks this is named with its line in the file."""
    text = read_text(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise MheError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON ({e.msg})") from e
    out: list[Example] = []
    arts = _get(data, "data", path, 0)
    if not isinstance(arts, list):
        raise MheError(f"{path}: 'data' must be a list of articles, got {type(arts).__name__}")
    for a, art in enumerate(arts):
        with record_shape(path, f"data[{a}]"):
            _squad_article(art, path, out, text=text, v2=t.name == "squad-v2")
    return out


def _squad_line(text: str, qid: str) -> str:
    """``line N: `` of the question ``qid`` in the file's text (where its id is written)."""
    at = text.find(json.dumps(str(qid)))
    return f"line {text.count(chr(10), 0, at) + 1}: " if at >= 0 else ""


def _squad_article(art, path, out: list, *, text: str, v2: bool) -> None:
    for para in art["paragraphs"]:
        ctx = para["context"]
        for qa in para["qas"]:
            problem = _squad_problem(qa, ctx, v2)
            if problem:  # the line is searched for only here: for every question it is quadratic
                raise MheError(f"{path}: {_squad_line(text, qa['id'])}question {qa['id']}: {problem}")
            impossible = v2 and bool(qa.get("is_impossible"))
            answers = [] if impossible else [(a["text"], a["answer_start"]) for a in qa["answers"]]
            out.append(Example(qa["question"], ctx, uid=qa["id"], answers=answers))


def _squad_problem(qa, ctx: str, v2: bool) -> str:
    """What is wrong with one question ('' when nothing is)."""
    if "answers" not in qa:
        return "malformed record (missing field 'answers')"
    impossible = v2 and bool(qa.get("is_impossible"))
    if not qa["answers"] and not impossible:
        return "no answer" + (" and not is_impossible" if v2 else " (every SQuAD v1.1 question has one)")
    for a in [] if impossible else qa["answers"]:
        answer, start = a["text"], a["answer_start"]
        if ctx[start:start + len(answer)] != answer:
            return f"answer {answer!r} not at offset {start}"
    return ""


READERS: dict[str, Callable[[BenchTask, Path], list[Example]]] = {
    "tsv": read_tsv, "cola": read_cola, "squad": read_squad, "axg": read_axg,
    **{name: read_jsonl for name in RECORD_PARSERS if name != "axg"},
}
