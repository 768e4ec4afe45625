"""SQuAD metrics against literal re-statements of the official v1.1 and v2.0 scripts."""

import random

import pytest

from mhe.errors import MheError
from mhe.metrics.squad import squad_scores
from squad_reference import as_dataset, v11_evaluate, v20_evaluate

# pieces that exercise the corner cases: empty, punctuation only, articles only, repeats
PIECES = ["", ".", "the", "a", "An", "!?", "interventionism", "Denver", "Broncos", "denver", "broncos",
          "Santa", "Clara", "the Denver Broncos", "  ", "1", "1.", "Paris,", "paris", "tower", "the the"]


def _text(rng):
    return " ".join(rng.choice(PIECES) for _ in range(rng.randint(0, 3)))


def _case(rng, n, unanswerable):
    golds, preds = {}, {}
    for i in range(n):
        k = 0 if (unanswerable and rng.random() < 0.3) else rng.randint(1, 3)
        golds[f"q{i}"] = [_text(rng) for _ in range(k)]
        preds[f"q{i}"] = _text(rng)
    return golds, preds


def test_issue_repro_answers_that_normalise_to_nothing():
    golds, preds = {"q": ["interventionism", "."]}, {"q": ""}
    v1 = squad_scores(preds, golds, version="v1.1")
    assert (v1["exact_match"], v1["f1"]) == (100.0, 0.0)
    v2 = squad_scores(preds, golds, version="v2.0")
    assert (v2["exact_match"], v2["f1"]) == (0.0, 0.0)
    assert v2["HasAns_total"] == 1 and "NoAns_total" not in v2
    ref1 = v11_evaluate(as_dataset(golds), preds)
    ref2 = v20_evaluate(as_dataset(golds), preds)
    assert (ref1["exact_match"], ref1["f1"]) == (100.0, 0.0) and (ref2["exact"], ref2["f1"]) == (0.0, 0.0)


@pytest.mark.parametrize("seed", range(40))
def test_v11_equals_official_script(seed):
    rng = random.Random(seed)
    golds, preds = _case(rng, 25, unanswerable=False)
    for q in rng.sample(sorted(preds), 3):  # the v1.1 script scores a missing prediction 0
        del preds[q]
    ours = squad_scores(preds, golds, version="v1.1")
    ref = v11_evaluate(as_dataset(golds), preds)
    assert ours["exact_match"] == pytest.approx(ref["exact_match"], abs=1e-12)
    assert ours["f1"] == pytest.approx(ref["f1"], abs=1e-12)
    assert ours["total"] == len(golds)


@pytest.mark.parametrize("seed", range(40))
def test_v20_equals_official_script(seed):
    rng = random.Random(1000 + seed)
    golds, preds = _case(rng, 25, unanswerable=True)
    ours = squad_scores(preds, golds, version="v2.0")
    ref = v20_evaluate(as_dataset(golds), preds)
    assert ours["exact_match"] == pytest.approx(ref["exact"], abs=1e-12)
    assert ours["f1"] == pytest.approx(ref["f1"], abs=1e-12)
    for split in ("HasAns", "NoAns"):
        assert (f"{split}_total" in ours) == (f"{split}_total" in ref)
        if f"{split}_total" in ref:
            assert ours[f"{split}_total"] == ref[f"{split}_total"]
            assert ours[f"{split}_exact"] == pytest.approx(ref[f"{split}_exact"], abs=1e-12)
            assert ours[f"{split}_f1"] == pytest.approx(ref[f"{split}_f1"], abs=1e-12)


def test_the_two_versions_differ_where_the_scripts_do():
    # both sides empty after normalisation: v1.1 F1 0, v2.0 F1 1; EM 1 in both
    for version, f1 in (("v1.1", 0.0), ("v2.0", 100.0)):
        r = squad_scores({"q": "the"}, {"q": ["."]}, version=version)
        assert (r["exact_match"], r["f1"]) == (100.0, f1)


def test_bad_inputs_raise():
    with pytest.raises(MheError, match="version"):
        squad_scores({"q": "x"}, {"q": ["x"]}, version="v3")
    with pytest.raises(MheError, match="no gold answer"):
        squad_scores({"q": "x"}, {"q": []}, version="v1.1")
