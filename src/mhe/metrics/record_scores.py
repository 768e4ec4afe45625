"""ReCoRD's official metric (Zhang et al. 2018; SuperGLUE): per query the maximum over the
gold answers of token exact match and token F1 with SQuAD's normalisation (lower case, no
punctuation, no articles), F1 0 when no token is shared; a query without a prediction scores
0. Percentages over every query."""

from __future__ import annotations

from mhe.errors import MheError
from mhe.metrics.squad import exact_match, f1_score


def record_scores(predictions: dict, golds: dict) -> dict:
    """``predictions``: query id -> predicted entity text; ``golds``: query id -> answer texts."""
    if not golds:
        raise MheError("record_scores needs at least one query")
    em = f1 = 0.0
    for qid, answers in golds.items():
        if not answers:
            raise MheError(f"ReCoRD query {qid!r} has no gold answer (the test split is unlabelled)")
        if qid not in predictions:
            continue
        pred = predictions[qid]
        em += max(exact_match(pred, a) for a in answers)
        f1 += max(f1_score(pred, a, "v1.1") for a in answers)
    return {"exact_match": 100 * em / len(golds), "f1": 100 * f1 / len(golds), "total": len(golds)}
