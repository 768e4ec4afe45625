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

ReCoRD has its own reader (:mod:`mhe.data.record_reader`). The file formats are read by the
functions registered in :data:`mhe.data.bench_readers.READERS`; a split without one example
is an error.
"""

from __future__ import annotations

from pathlib import Path

from mhe.data.bench_hub import HUB, from_hub
from mhe.data.bench_readers import READERS
from mhe.data.bench_types import BenchTask, Example
from mhe.data.paths import data_root, find_file
from mhe.errors import MheError, one_of

__all__ = ["BENCH_TASKS", "BenchTask", "Example", "bench_task", "read_examples", "task_files"]


def _t(name, bench, kind, labels, files, reader, columns=()):
    return BenchTask(name, bench, kind, tuple(labels), files, reader, tuple(columns))


def _glue(name, labels, files, columns, kind="classification"):
    """A GLUE task in TSV: ``columns`` names the first text, second text ("" for none) and label."""
    return _t(name, "glue", kind, labels, files, "tsv", columns)


GLUE_FILES = lambda d: {"train": [f"glue/{d}/train.tsv"], "dev": [f"glue/{d}/dev.tsv"]}  # noqa: E731
SG_FILES = lambda d: {"train": [f"superglue/{d}/train.jsonl"], "dev": [f"superglue/{d}/val.jsonl"]}  # noqa: E731

BENCH_TASKS = {
    "cola": _t("cola", "glue", "classification", ["0", "1"],
               {"train": [["glue/CoLA/train.tsv"], ["glue/CoLA/in_domain_train.tsv"]],
                "dev": [["glue/CoLA/dev.tsv"], ["glue/CoLA/in_domain_dev.tsv", "glue/CoLA/out_of_domain_dev.tsv"]]},
               "cola"),
    "sst2": _glue("sst2", ["0", "1"], GLUE_FILES("SST-2"), ("sentence", "", "label")),
    "mrpc": _glue("mrpc", ["0", "1"], GLUE_FILES("MRPC"), ("#1 String", "#2 String", "Quality")),
    "stsb": _glue("stsb", [], GLUE_FILES("STS-B"), ("sentence1", "sentence2", "score"), kind="regression"),
    "qqp": _glue("qqp", ["0", "1"], GLUE_FILES("QQP"), ("question1", "question2", "is_duplicate")),
    "mnli": _glue("mnli", ["entailment", "neutral", "contradiction"],
                  {"train": ["glue/MNLI/train.tsv"], "dev": ["glue/MNLI/dev_matched.tsv"]},
                  ("sentence1", "sentence2", "gold_label")),
    "mnli-mm": _glue("mnli-mm", ["entailment", "neutral", "contradiction"],
                     {"train": ["glue/MNLI/train.tsv"], "dev": ["glue/MNLI/dev_mismatched.tsv"]},
                     ("sentence1", "sentence2", "gold_label")),
    "qnli": _glue("qnli", ["entailment", "not_entailment"], GLUE_FILES("QNLI"), ("question", "sentence", "label")),
    "rte": _glue("rte", ["entailment", "not_entailment"], GLUE_FILES("RTE"), ("sentence1", "sentence2", "label")),
    "wnli": _glue("wnli", ["0", "1"], GLUE_FILES("WNLI"), ("sentence1", "sentence2", "label")),
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
    if name not in BENCH_TASKS:
        raise one_of("fine-tuning task", name, BENCH_TASKS)
    return BENCH_TASKS[name]


def finetuning_tasks() -> str:
    """The tasks ``mhe finetune`` takes, by benchmark, and the diagnostics (for help texts)."""
    groups: dict[str, list[str]] = {}
    for t in BENCH_TASKS.values():
        if t.kind != "diagnostic":
            groups.setdefault({"glue": "GLUE", "superglue": "SuperGLUE", "squad": "SQuAD"}[t.benchmark], []).append(t.name)
    diag = [t.name for t in BENCH_TASKS.values() if t.kind == "diagnostic"]
    return "; ".join(f"{b}: {', '.join(names)}" for b, names in groups.items()) + \
        f" ({', '.join(diag)}: scored with an RTE run by mhe diagnostics)"


def task_files(name: str, split: str, *, data_dir=None) -> list[Path]:
    """The local files of ``split`` of task ``name``, checked to exist (nothing is read)."""
    t = bench_task(name)
    if split not in t.files:
        raise one_of(f"split of {name}", split, t.files)
    return _resolve(t.files[split], data_root(data_dir))


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
        out = from_hub(t, split)
        return out[:limit] if limit else out
    if source != "local":
        raise one_of("data source", source, ("local", "hub"))
    paths = task_files(name, split, data_dir=data_dir)
    out: list[Example] = []
    for p in paths:
        out.extend(READERS[t.reader](t, p))
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
