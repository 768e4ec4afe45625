"""GLUE and SuperGLUE metrics (Wang et al. 2018, 2019), with scikit-learn and scipy for the
statistics. Each task's official metric comes first in :data:`OFFICIAL`."""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from mhe.errors import MheError


def accuracy(pred, gold) -> float:
    pred, gold = np.asarray(pred), np.asarray(gold)
    return float((pred == gold).mean())


def f1(pred, gold) -> float:
    """Binary F1 of the positive class (label 1)."""
    from sklearn.metrics import f1_score

    return float(f1_score(gold, pred, pos_label=1, average="binary", zero_division=0))


def macro_f1(pred, gold) -> float:
    from sklearn.metrics import f1_score

    return float(f1_score(gold, pred, average="macro", zero_division=0))


def matthews(pred, gold) -> float:
    from sklearn.metrics import matthews_corrcoef

    return float(matthews_corrcoef(gold, pred))


def pearson(pred, gold) -> float:
    from scipy.stats import pearsonr

    return float(pearsonr(pred, gold)[0])


def spearman(pred, gold) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(pred, gold)[0])


def multirc(pred, gold, question_ids) -> dict:
    """MultiRC (Khashabi et al. 2018): F1a over every answer option, and exact match per
    question (all of its options right)."""
    per_q = defaultdict(list)
    for p, g, q in zip(pred, gold, question_ids):
        per_q[q].append(p == g)
    return {"f1a": f1(pred, gold), "em": float(np.mean([all(v) for v in per_q.values()]))}


def gender_parity(pred, groups) -> float:
    """AX-g (Rudinger et al. 2018, SuperGLUE's Winogender diagnostic): the fraction of minimal
    pairs (examples sharing a ``groups`` value, two each) given the same prediction."""
    per_pair = defaultdict(list)
    for p, g in zip(pred, groups):
        per_pair[g].append(p)
    sizes = {len(v) for v in per_pair.values()}
    if sizes != {2}:
        raise MheError(f"gender parity needs minimal pairs (two examples per pair), got group sizes {sorted(sizes)}")
    return float(np.mean([a == b for a, b in per_pair.values()]))


# task -> (official metric, every metric); the functions take (pred, gold)
OFFICIAL = {
    "cola": ("matthews_corrcoef", {"matthews_corrcoef": matthews, "accuracy": accuracy}),
    "sst2": ("accuracy", {"accuracy": accuracy}),
    "mrpc": ("f1", {"f1": f1, "accuracy": accuracy}),
    "qqp": ("f1", {"f1": f1, "accuracy": accuracy}),
    "stsb": ("spearman", {"spearman": spearman, "pearson": pearson}),
    "mnli": ("accuracy", {"accuracy": accuracy}),
    "mnli-mm": ("accuracy", {"accuracy": accuracy}),
    "qnli": ("accuracy", {"accuracy": accuracy}),
    "rte": ("accuracy", {"accuracy": accuracy}),
    "wnli": ("accuracy", {"accuracy": accuracy}),
    "ax-b": ("matthews_corrcoef", {"matthews_corrcoef": matthews, "accuracy": accuracy}),
    "ax-g": ("gender_parity", {"accuracy": accuracy}),
    "boolq": ("accuracy", {"accuracy": accuracy}),
    "cb": ("f1_macro", {"f1_macro": macro_f1, "accuracy": accuracy}),
    "sg-rte": ("accuracy", {"accuracy": accuracy}),
    "wic": ("accuracy", {"accuracy": accuracy}),
    "copa": ("accuracy", {"accuracy": accuracy}),
    "wsc": ("accuracy", {"accuracy": accuracy}),
    "multirc": ("f1a", {}),
}


# The paper's headline metric where it differs from the benchmark's first official one (Appendix A:
# "matched accuracy for MNLI, Matthews correlation for CoLA, Spearman correlation for STS, F1 score for
# QQP, CB, MultiRC and SQuAD and accuracy for all other tasks"): MRPC is reported as accuracy.
PAPER_HEADLINE = {"mrpc": "accuracy"}


def headline_metric(task: str) -> str:
    """The metric the paper reports for ``task`` (the results' ``metric`` and ``score``)."""
    return PAPER_HEADLINE.get(task, OFFICIAL[task][0])


def official_metrics(task: str) -> list[str]:
    """Every metric the benchmark defines for ``task`` (GLUE/SuperGLUE), the official first."""
    name, fns = OFFICIAL[task]
    return ["f1a", "em"] if task == "multirc" else [name] + [k for k in fns if k != name]


def task_metrics(task: str, pred, gold, **extra) -> dict:
    """Every official metric of ``task``; ``metric`` names the paper's headline one and ``score``
    is its value; ``official`` lists all of them (MRPC: accuracy headline, F1 also reported)."""
    _, fns = OFFICIAL[task]
    out = {k: fn(pred, gold) for k, fn in fns.items()}
    if task == "multirc":
        out.update(multirc(pred, gold, extra["question_ids"]))
    if task == "ax-g":
        out["gender_parity"] = gender_parity(pred, extra["pair_ids"])
    name = headline_metric(task)
    return {"metric": name, "score": out[name], "official": official_metrics(task), **out}
