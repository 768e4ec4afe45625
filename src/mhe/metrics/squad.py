"""SQuAD v1.1 and v2.0 exact match and F1, written from the official evaluation's definition
(Rajpurkar et al. 2016, 2018): answers are normalised (lower case, no punctuation, no
articles a/an/the, single spaces); a prediction scores the maximum over the gold answers;
v2.0 unanswerable questions have the empty string as their only gold answer."""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not p or not g:  # unanswerable: both empty scores 1, otherwise 0
        return float(p == g)
    common = Counter(p) & Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def squad_scores(predictions: dict, golds: dict) -> dict:
    """``predictions``: id -> text; ``golds``: id -> list of gold answers ([] = unanswerable).
    Returns percentages: exact_match, f1 and, when both kinds occur, HasAns_/NoAns_ splits."""
    em, f1, has, no = {}, {}, [], []
    for qid, answers in golds.items():
        pred = predictions.get(qid, "")
        answers = answers or [""]
        em[qid] = max(exact_match(pred, a) for a in answers)
        f1[qid] = max(f1_score(pred, a) for a in answers)
        (has if any(a for a in answers) else no).append(qid)
    out = {"exact_match": 100 * sum(em.values()) / len(em), "f1": 100 * sum(f1.values()) / len(f1),
           "total": len(em)}
    for name, ids in (("HasAns", has), ("NoAns", no)):
        if ids and (has and no):
            out[f"{name}_exact"] = 100 * sum(em[i] for i in ids) / len(ids)
            out[f"{name}_f1"] = 100 * sum(f1[i] for i in ids) / len(ids)
            out[f"{name}_total"] = len(ids)
    return out
