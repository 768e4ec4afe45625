"""SQuAD v1.1 and v2.0 exact match and F1, as the official evaluation scripts compute them
(Rajpurkar et al. 2016, 2018).

Both versions normalise an answer the same way (lower case, drop punctuation, drop the
articles a/an/the, collapse white space) and score a prediction by the maximum over the gold
answers. They differ where an answer normalises to nothing:

* v1.1: exact match compares the normalised strings (so "" equals "."), but F1 is 0 whenever
  no token is shared, even when both sides are empty;
* v2.0: gold answers that normalise to nothing are dropped first, and a question left with
  none has the single gold answer ""; F1 is ``int(pred_tokens == gold_tokens)`` when either
  side has no tokens. The HasAns/NoAns split follows the raw gold list (empty = NoAns).
"""

from __future__ import annotations

import re
import string
from collections import Counter

from mhe.errors import MheError, one_of

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
VERSIONS = ("v1.1", "v2.0")


def normalize_answer(s: str) -> str:
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def _overlap_f1(p: list[str], g: list[str]) -> float:
    same = sum((Counter(p) & Counter(g)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, gold: str, version: str = "v2.0") -> float:
    """Token F1 of one prediction against one gold answer.

    v1.1 scores 0 when no token is shared (also when both are empty); v2.0 scores
    ``float(p == g)`` when either side has no tokens (both empty: 1)."""
    p, g = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if version == "v2.0" and (not p or not g):
        return float(p == g)
    return _overlap_f1(p, g)


def _golds_v2(answers: list[str]) -> list[str]:
    kept = [a for a in answers if normalize_answer(a)]
    return kept or [""]


def squad_scores(predictions: dict, golds: dict, version: str | None = None) -> dict:
    """Exact match and F1 (percentages) as the official script of ``version`` computes them.

    Args:
        predictions: question id -> predicted text.
        golds: question id -> list of gold answer texts (``[]``: unanswerable, v2.0 only).
        version: ``"v1.1"`` or ``"v2.0"``; by default v2.0 when some question has no gold
            answer, else v1.1.

    Returns:
        ``exact_match``, ``f1``, ``total``; for v2.0 also ``HasAns_exact``,
        ``HasAns_f1``, ``HasAns_total`` when some question has an answer and the ``NoAns_``
        three when some has none (as the v2.0 script reports them).

    A question without a prediction scores 0 under v1.1 (as its script does) and is scored as
    the empty prediction (abstaining) under v2.0.
    """
    if version is None:
        version = "v2.0" if any(not a for a in golds.values()) else "v1.1"
    if version not in VERSIONS:
        raise one_of("SQuAD version", version, VERSIONS)
    if not golds:
        raise MheError("squad_scores needs at least one question")
    em, f1, has, no = {}, {}, [], []
    for qid, answers in golds.items():
        if version == "v1.1":
            if not answers:
                raise MheError(f"question {qid!r} has no gold answer; SQuAD v1.1 has none such (use version='v2.0')")
            if qid not in predictions:
                em[qid] = f1[qid] = 0.0
                continue
            pred = predictions[qid]
            em[qid] = max(exact_match(pred, a) for a in answers)
            f1[qid] = max(f1_score(pred, a, "v1.1") for a in answers)
            continue
        pred = predictions.get(qid, "")
        (has if answers else no).append(qid)
        kept = _golds_v2(answers)
        em[qid] = max(exact_match(pred, a) for a in kept)
        f1[qid] = max(f1_score(pred, a, "v2.0") for a in kept)
    out = {"exact_match": 100 * sum(em.values()) / len(em), "f1": 100 * sum(f1.values()) / len(f1),
           "total": len(em)}
    for name, ids in (("HasAns", has), ("NoAns", no)):
        if ids:
            out[f"{name}_exact"] = 100 * sum(em[i] for i in ids) / len(ids)
            out[f"{name}_f1"] = 100 * sum(f1[i] for i in ids) / len(ids)
            out[f"{name}_total"] = len(ids)
    return out
