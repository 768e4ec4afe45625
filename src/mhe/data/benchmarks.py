"""GLUE, SuperGLUE and SQuAD readers for their official file formats.

Every task yields :class:`Example` records. Input construction:

* pairs (RTE, MRPC, STS-B, QNLI, QQP, MNLI, CB, BoolQ): ``text_a`` [SEP] ``text_b``
  (BoolQ: question, then passage);
* WiC: the target word is marked ``*word*`` in both sentences and prepended to the first;
* WSC: the two spans are marked in the text, ``*span1*`` and ``#span2#``, a single input;
* COPA: a choice between two (premise + "What was the cause?" / "What happened as a
  result?", alternative) pairs, scored by one logit each;
* MultiRC: one binary decision per (paragraph, question + answer), grouped by question;
* SQuAD: (question, context) with character offsets of every gold answer;
* WNLI (GLUE): sentence1 [SEP] sentence2;
* AX-b and AX-g (SuperGLUE diagnostics, test split only, labelled): RTE-style pairs scored
  by a model fine-tuned on RTE (``mhe diagnostics``); AX-g's ``group`` names each minimal
  pair (two consecutive records with the same hypothesis, differing in the pronoun's gender).

ReCoRD has its own reader (:mod:`mhe.data.record`).

A record with missing fields, of the wrong structure or with a label outside the
task's label set raises an error naming the file and record (the line, for JSONL and
TSV); so does a split without one example.
"""

from __future__ import annotations

import csv
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from mhe.data.paths import data_root, find_file, iter_lines, open_text, read_text, record_shape
from mhe.errors import MheError, one_of


@dataclass
class Example:
    text_a: str
    text_b: str | None = None
    label: float | int | None = None
    group: str = ""  # MultiRC question id
    choices: list = field(default_factory=list)  # COPA alternatives
    uid: str = ""
    answers: list = field(default_factory=list)  # SQuAD: [(text, char_start)]


@dataclass(frozen=True)
class BenchTask:
    name: str
    benchmark: str  # glue | superglue | squad
    kind: str  # classification | regression | choice | span | diagnostic
    labels: tuple  # label names, in id order (empty for regression/span)
    files: dict  # split -> relative path(s) without .gz/.xz
    reader: str


def _t(name, bench, kind, labels, files, reader):
    return BenchTask(name, bench, kind, tuple(labels), files, reader)


GLUE_FILES = lambda d: {"train": [f"glue/{d}/train.tsv"], "dev": [f"glue/{d}/dev.tsv"]}  # noqa: E731
SG_FILES = lambda d: {"train": [f"superglue/{d}/train.jsonl"], "dev": [f"superglue/{d}/val.jsonl"]}  # noqa: E731

TASKS = {
    "cola": _t("cola", "glue", "classification", ["0", "1"],
               {"train": [["glue/CoLA/train.tsv"], ["glue/CoLA/in_domain_train.tsv"]],
                "dev": [["glue/CoLA/dev.tsv"], ["glue/CoLA/in_domain_dev.tsv", "glue/CoLA/out_of_domain_dev.tsv"]]},
               "cola"),
    "sst2": _t("sst2", "glue", "classification", ["0", "1"], GLUE_FILES("SST-2"), "tsv:sentence::label"),
    "mrpc": _t("mrpc", "glue", "classification", ["0", "1"], GLUE_FILES("MRPC"), "tsv:#1 String:#2 String:Quality"),
    "stsb": _t("stsb", "glue", "regression", [], GLUE_FILES("STS-B"), "tsv:sentence1:sentence2:score"),
    "qqp": _t("qqp", "glue", "classification", ["0", "1"], GLUE_FILES("QQP"), "tsv:question1:question2:is_duplicate"),
    "mnli": _t("mnli", "glue", "classification", ["entailment", "neutral", "contradiction"],
               {"train": ["glue/MNLI/train.tsv"], "dev": ["glue/MNLI/dev_matched.tsv"]}, "tsv:sentence1:sentence2:gold_label"),
    "mnli-mm": _t("mnli-mm", "glue", "classification", ["entailment", "neutral", "contradiction"],
                  {"train": ["glue/MNLI/train.tsv"], "dev": ["glue/MNLI/dev_mismatched.tsv"]},
                  "tsv:sentence1:sentence2:gold_label"),
    "qnli": _t("qnli", "glue", "classification", ["entailment", "not_entailment"], GLUE_FILES("QNLI"),
               "tsv:question:sentence:label"),
    "rte": _t("rte", "glue", "classification", ["entailment", "not_entailment"], GLUE_FILES("RTE"),
              "tsv:sentence1:sentence2:label"),
    "wnli": _t("wnli", "glue", "classification", ["0", "1"], GLUE_FILES("WNLI"), "tsv:sentence1:sentence2:label"),
    # SuperGLUE diagnostics: evaluation only, with a model fine-tuned on RTE (same label order)
    "ax-b": _t("ax-b", "superglue", "diagnostic", ["entailment", "not_entailment"],
               {"test": ["superglue/AX-b/AX-b.jsonl"]}, "axb"),
    "ax-g": _t("ax-g", "superglue", "diagnostic", ["entailment", "not_entailment"],
               {"test": ["superglue/AX-g/AX-g.jsonl"]}, "axg"),
    "boolq": _t("boolq", "superglue", "classification", ["False", "True"], SG_FILES("BoolQ"), "boolq"),
    "cb": _t("cb", "superglue", "classification", ["entailment", "contradiction", "neutral"], SG_FILES("CB"), "nli"),
    "sg-rte": _t("sg-rte", "superglue", "classification", ["entailment", "not_entailment"], SG_FILES("RTE"), "nli"),
    "wic": _t("wic", "superglue", "classification", ["False", "True"], SG_FILES("WiC"), "wic"),
    "multirc": _t("multirc", "superglue", "classification", ["0", "1"], SG_FILES("MultiRC"), "multirc"),
    "copa": _t("copa", "superglue", "choice", ["0", "1"], SG_FILES("COPA"), "copa"),
    "wsc": _t("wsc", "superglue", "classification", ["False", "True"], SG_FILES("WSC"), "wsc"),
    "squad": _t("squad", "squad", "span", [], {"train": ["squad/v1.1/train-v1.1.json"],
                                              "dev": ["squad/v1.1/dev-v1.1.json"]}, "squad"),
    "squad-v2": _t("squad-v2", "squad", "span", [], {"train": ["squad/v2.0/train-v2.0.json"],
                                                    "dev": ["squad/v2.0/dev-v2.0.json"]}, "squad"),
}


def bench_task(name: str) -> BenchTask:
    if name not in TASKS:
        raise one_of("fine-tuning task", name, TASKS)
    return TASKS[name]


def read_examples(name: str, split: str, *, data_dir=None, limit: int | None = None,
                  source: str = "local") -> list[Example]:
    """The examples of ``split`` (train or dev) of task ``name``, from local files or, with
    ``source="hub"`` and the optional ``datasets`` package, from the hub's copies."""
    t = bench_task(name)
    if split not in t.files:
        raise one_of(f"split of {name}", split, t.files)
    if source == "hub":
        if t.name not in HUB:
            raise MheError(f"{t.name} has no hub copy here; use local files (--data-dir)")
        out = _from_hub(t, split)
        return out[:limit] if limit else out
    if source != "local":
        raise one_of("data source", source, ("local", "hub"))
    root = data_root(data_dir)
    paths = _resolve(t.files[split], root)
    out: list[Example] = []
    for p in paths:
        out.extend(_read(t, p))
    if not out:
        raise MheError(f"{', '.join(str(p) for p in paths)}: the {split} split of {name} has no examples")
    return out[:limit] if limit else out


def _resolve(spec, root: Path) -> list[Path]:
    """``spec`` is a list of paths, or a list of alternatives (lists): the first that exists."""
    if spec and isinstance(spec[0], list):
        errors = []
        for alt in spec:
            try:
                return [find_file(p, root) for p in alt]
            except MheError as e:
                errors.append(str(e))
        raise MheError(errors[0])
    return [find_file(p, root) for p in spec]


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


def _read(t: BenchTask, path: Path) -> list[Example]:
    r = t.reader
    if r.startswith("tsv:"):
        return _read_tsv(t, path, *r[4:].split(":"))
    if r == "cola":
        return _read_cola(t, path)
    if r == "squad":
        return _read_squad(path)
    return _read_jsonl(t, path)


def _read_tsv(t, path, col_a, col_b, col_label):
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


def _read_cola(t, path):
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


TAG = re.compile(r"<[^>]+>")


def _read_jsonl(t, path):
    out = []
    if t.reader == "axg":
        return _pair_axg(_read_records(t, path), path)
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise MheError(f"{path}: record {n}: not valid JSON") from e
            out.extend(_parse_record(t, rec, path, n))
    return out


def _read_records(t, path):
    out = []
    with open_text(path) as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as e:
                    raise MheError(f"{path}: record {n}: not valid JSON") from e
                out.extend(_parse_record(t, rec, path, n))
    return out


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


def _parse_record(t, rec, path, n) -> list[Example]:
    """One official SuperGLUE record -> examples (MultiRC: one per answer); a field of the
    wrong type or structure raises :class:`MheError` naming the file and record."""
    if not isinstance(rec, dict):
        raise MheError(f"{path}: record {n}: expected a JSON object, got a JSON {type(rec).__name__}")
    with record_shape(path, f"record {n}"):
        return _parse_fields(t, rec, path, n)


def _parse_fields(t, rec, path, n) -> list[Example]:
    g = lambda k: _get(rec, k, path, n)  # noqa: E731
    lab = lambda v: _label(t, v, path, f"record {n}")  # noqa: E731
    uid = str(rec.get("idx", n))
    if t.reader == "boolq":
        return [Example(g("question"), g("passage"), lab(g("label")), uid=uid)]
    if t.reader in ("nli", "axg"):
        return [Example(g("premise"), g("hypothesis"), lab(g("label")), uid=uid)]
    if t.reader == "axb":
        return [Example(g("sentence1"), g("sentence2"), lab(g("label")), uid=uid, group=rec.get("logic", ""))]
    if t.reader == "wic":
        s1 = _mark(g("sentence1"), g("start1"), g("end1"), "*")
        s2 = _mark(g("sentence2"), g("start2"), g("end2"), "*")
        return [Example(f"{g('word')}: {s1}", s2, lab(g("label")), uid=uid)]
    if t.reader == "wsc":
        target = g("target")
        words = g("text").split()
        for key, sym in (("span1", "*"), ("span2", "#")):
            i = target[f"{key}_index"]
            k = len(target[f"{key}_text"].split())
            if i + k > len(words):
                raise MheError(f"{path}: record {n}: {key} index {i} outside the text")
            words[i] = sym + words[i]
            words[i + k - 1] = words[i + k - 1] + sym
        return [Example(" ".join(words), None, lab(g("label")), uid=uid)]
    if t.reader == "copa":
        if g("question") not in ("cause", "effect"):
            raise MheError(f"{path}: record {n}: question {g('question')!r} is not one of cause, effect")
        ask = {"cause": "What was the cause?", "effect": "What happened as a result?"}[g("question")]
        return [Example(f"{g('premise')} {ask}", None, lab(g("label")), choices=[g("choice1"), g("choice2")], uid=uid)]
    passage = " ".join(TAG.sub(" ", g("passage")["text"]).split())  # multirc
    out = []
    for qi, q in enumerate(g("passage")["questions"]):
        for ai, a in enumerate(q["answers"]):
            out.append(Example(passage, f"{q['question']} {a['text']}", lab(a.get("label")),
                               group=f"{uid}-{qi}", uid=f"{uid}-{qi}-{ai}"))
    return out


def _read_squad(path):
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as e:
        raise MheError(f"{path}: line {e.lineno} column {e.colno}: not valid JSON ({e.msg})") from e
    out: list[Example] = []
    arts = _get(data, "data", path, 0)
    if not isinstance(arts, list):
        raise MheError(f"{path}: 'data' must be a list of articles, got {type(arts).__name__}")
    for a, art in enumerate(arts):
        with record_shape(path, f"data[{a}]"):
            _squad_article(art, path, out)
    return out


def _squad_article(art, path, out: list) -> None:
    for para in art["paragraphs"]:
        ctx = para["context"]
        for qa in para["qas"]:
            answers = [(a["text"], a["answer_start"]) for a in qa.get("answers", [])]
            if qa.get("is_impossible"):
                answers = []
            for text, start in answers:
                if ctx[start:start + len(text)] != text:
                    raise MheError(f"{path}: question {qa['id']}: answer {text!r} not at offset {start}")
            out.append(Example(qa["question"], ctx, uid=qa["id"], answers=answers))


# task -> (hub dataset, configuration, validation split)
HUB = {"cola": ("nyu-mll/glue", "cola", "validation"), "sst2": ("nyu-mll/glue", "sst2", "validation"),
       "mrpc": ("nyu-mll/glue", "mrpc", "validation"), "stsb": ("nyu-mll/glue", "stsb", "validation"),
       "qqp": ("nyu-mll/glue", "qqp", "validation"), "mnli": ("nyu-mll/glue", "mnli", "validation_matched"),
       "mnli-mm": ("nyu-mll/glue", "mnli", "validation_mismatched"), "qnli": ("nyu-mll/glue", "qnli", "validation"),
       "rte": ("nyu-mll/glue", "rte", "validation"), "wnli": ("nyu-mll/glue", "wnli", "validation"),
       "boolq": ("aps/super_glue", "boolq", "validation"),
       "cb": ("aps/super_glue", "cb", "validation"), "sg-rte": ("aps/super_glue", "rte", "validation"),
       "wic": ("aps/super_glue", "wic", "validation"), "multirc": ("aps/super_glue", "multirc", "validation"),
       "copa": ("aps/super_glue", "copa", "validation"), "wsc": ("aps/super_glue", "wsc.fixed", "validation"),
       "squad": ("rajpurkar/squad", None, "validation"), "squad-v2": ("rajpurkar/squad_v2", None, "validation")}
# GLUE text columns on the hub (labels there are already the indices of our label lists)
HUB_TEXT = {"cola": ("sentence", None), "sst2": ("sentence", None), "mrpc": ("sentence1", "sentence2"),
            "stsb": ("sentence1", "sentence2"), "qqp": ("question1", "question2"), "mnli": ("premise", "hypothesis"),
            "mnli-mm": ("premise", "hypothesis"), "qnli": ("question", "sentence"), "rte": ("sentence1", "sentence2"),
            "wnli": ("sentence1", "sentence2")}


def _from_hub(t: BenchTask, split: str) -> list[Example]:
    try:
        import datasets
    except ImportError as e:
        files = ", ".join(str(p) for p in t.files[split]) if not isinstance(t.files[split][0], list) else t.name
        raise MheError(f"loading {t.name} from the hub needs the optional 'datasets' package "
                       f"(pip install mhe[datasets]); offline, put {files} under --data-dir") from e
    name, config, valid = HUB[t.name]
    hub_split = "train" if split == "train" else valid
    try:
        rows = datasets.load_dataset(name, config, split=hub_split)
    except Exception as e:
        raise MheError(f"could not load {name} ({config}) from the hub ({type(e).__name__}); "
                       "offline, point --data-dir at local files") from e
    where = Path(f"{name}:{hub_split}")
    out: list[Example] = []
    for n, r in enumerate(rows):
        if t.name in HUB_TEXT:
            a, b = HUB_TEXT[t.name]
            label = float(r["label"]) if t.kind == "regression" else int(r["label"])
            if t.kind != "regression" and not 0 <= label < len(t.labels):
                raise MheError(f"{where}: record {n}: label {label} outside 0..{len(t.labels) - 1}")
            out.append(Example(r[a], r[b] if b else None, label, uid=str(r.get("idx", n))))
        elif t.reader == "squad":
            ans = r["answers"]
            out.append(Example(r["question"], r["context"], uid=r["id"],
                               answers=list(zip(ans["text"], ans["answer_start"]))))
        else:
            out.extend(_hub_superglue(t, r, n, where))
    return out


def _hub_superglue(t: BenchTask, r: dict, n: int, where: Path) -> list[Example]:
    """Rewrite one hub row into the official JSONL record and parse it like a local file."""
    label = t.labels[int(r["label"])] if t.reader != "multirc" else int(r["label"])
    if t.reader in ("boolq", "wic", "copa"):
        rec = dict(r)
    elif t.reader == "nli":
        rec = {"premise": r["premise"], "hypothesis": r["hypothesis"]}
    elif t.reader == "wsc":
        rec = {"text": r["text"], "target": {k: r[k] for k in ("span1_index", "span2_index", "span1_text", "span2_text")}}
    else:  # multirc: one row per answer on the hub
        idx = r["idx"]
        rec = {"idx": f"{idx['paragraph']}", "passage": {"text": r["paragraph"], "questions": [
            {"question": r["question"], "answers": [{"text": r["answer"], "label": label}]}]}}
        ex = _parse_record(t, rec, where, n)
        for e in ex:
            e.group = f"{idx['paragraph']}-{idx['question']}"
        return ex
    rec["label"] = label if t.reader != "copa" else int(r["label"])
    return _parse_record(t, rec, where, n)
