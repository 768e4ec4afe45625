"""The hub's copies of the benchmarks (``data.source=hub``, the optional ``datasets``
package), rewritten into the records the local readers produce."""

from __future__ import annotations

from pathlib import Path

from mhe.data.bench_readers import parse_record
from mhe.data.bench_types import BenchTask, Example
from mhe.data.paths import hub_split
from mhe.errors import MheError

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


def from_hub(t: BenchTask, split: str) -> list[Example]:
    files = ", ".join(str(p) for p in t.files[split]) if not isinstance(t.files[split][0], list) else t.name
    name, config, valid = HUB[t.name]
    which = "train" if split == "train" else valid
    rows = hub_split(t.name, name, config, which, offline=f"put {files} under --data-dir")
    where = Path(f"{name}:{which}")
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
        ex = parse_record(t, rec, where, n)
        for e in ex:
            e.group = f"{idx['paragraph']}-{idx['question']}"
        return ex
    rec["label"] = label if t.reader != "copa" else int(r["label"])
    return parse_record(t, rec, where, n)
