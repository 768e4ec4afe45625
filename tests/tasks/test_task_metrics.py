"""Task metrics against hand-worked cases."""

import math

import pytest

from mhe.errors import MheError
from mhe.metrics.classification import task_metrics
from mhe.metrics.squad import exact_match, f1_score, normalize_answer, squad_scores


def test_matthews_by_hand():
    pred, gold = [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1]
    tp, tn, fp, fn = 2, 2, 1, 1
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    r = task_metrics("cola", pred, gold)
    assert r["metric"] == "matthews_corrcoef" and r["score"] == pytest.approx(mcc) and r["accuracy"] == 4 / 6


def test_f1_and_macro_f1_by_hand():
    r = task_metrics("mrpc", [1, 1, 1, 0], [1, 0, 1, 1])  # tp 2, fp 1, fn 1
    assert r["f1"] == pytest.approx(2 / 3) and r["accuracy"] == 0.5
    # the paper reports MRPC accuracy (Appendix A); GLUE's official F1 is reported beside it
    assert r["metric"] == "accuracy" and r["score"] == 0.5 and r["official"] == ["f1", "accuracy"]
    r = task_metrics("qqp", [1, 1, 1, 0], [1, 0, 1, 1])
    assert r["metric"] == "f1" and r["score"] == pytest.approx(2 / 3) and r["official"] == ["f1", "accuracy"]
    # CB: three classes; per-class F1: c0 (tp1 fp0 fn1) 2/3, c1 (tp1 fp1 fn0) 2/3, c2 (tp0 fp1 fn1) 0
    r = task_metrics("cb", [0, 1, 1, 2], [0, 1, 2, 0])
    assert r["metric"] == "f1_macro" and r["score"] == pytest.approx((2 / 3 + 2 / 3 + 0) / 3)


def test_correlations_by_hand():
    r = task_metrics("stsb", [1.0, 2.0, 3.0, 4.0], [1.0, 3.0, 2.0, 5.0])
    assert r["metric"] == "spearman" and r["spearman"] == pytest.approx(0.8)  # 1 - 6*2/(4*15)
    assert r["official"] == ["spearman", "pearson"]
    xs, ys = [1, 2, 3, 4], [1, 3, 2, 5]
    mx, my = 2.5, 2.75
    cov = sum((a - mx) * (b - my) for a, b in zip(xs, ys))
    p = cov / math.sqrt(sum((a - mx) ** 2 for a in xs) * sum((b - my) ** 2 for b in ys))
    assert r["pearson"] == pytest.approx(p)


def test_multirc_f1a_and_em_by_hand():
    # question A: 2 options, both right; question B: 3 options, one wrong
    pred = [1, 0, 1, 1, 0]
    gold = [1, 0, 1, 0, 0]
    qids = ["A", "A", "B", "B", "B"]
    r = task_metrics("multirc", pred, gold, question_ids=qids)
    assert r["metric"] == "f1a" and r["em"] == 0.5 and r["official"] == ["f1a", "em"]
    assert r["f1a"] == pytest.approx(2 * (2 / 3) * 1 / (2 / 3 + 1))  # tp 2, fp 1, fn 0


def test_squad_normalisation_and_scores():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple a day") == "apple day"
    assert exact_match("the Eiffel Tower", "Eiffel Tower.") == 1.0
    assert f1_score("Eiffel Tower in Paris", "the Eiffel Tower") == pytest.approx(2 * 0.5 * 1 / 1.5)
    golds = {"q1": ["Denver Broncos", "The Denver Broncos"], "q2": ["Santa Clara"], "q3": []}
    preds = {"q1": "Denver Broncos", "q2": "Santa Clara, California", "q3": ""}
    r = squad_scores(preds, golds)
    assert r["exact_match"] == pytest.approx(100 * 2 / 3)
    assert r["f1"] == pytest.approx(100 * (1 + 2 * (2 / 3) / (2 / 3 + 1) + 1) / 3)
    assert r["HasAns_total"] == 2 and r["NoAns_exact"] == 100.0
    assert squad_scores({"q3": "something"}, {"q3": []})["f1"] == 0.0


def test_diagnostic_metrics_by_hand():
    # AX-g: three minimal pairs; the second pair's predictions differ
    r = task_metrics("ax-g", [0, 0, 1, 0, 1, 1], [0, 1, 1, 1, 1, 0], pair_ids=["a", "a", "b", "b", "c", "c"])
    assert r["metric"] == "gender_parity" and r["score"] == pytest.approx(2 / 3) and r["accuracy"] == 0.5
    with pytest.raises(MheError, match="minimal pairs"):
        task_metrics("ax-g", [0, 1, 1], [0, 1, 1], pair_ids=["a", "a", "a"])
    r = task_metrics("ax-b", [1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 1, 1])
    assert r["metric"] == "matthews_corrcoef" and r["score"] == pytest.approx((2 * 2 - 1 * 1) / 9)
    assert task_metrics("wnli", [0, 1, 1], [0, 1, 0])["accuracy"] == pytest.approx(2 / 3)
