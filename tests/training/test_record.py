"""ReCoRD: the official JSONL format, entity-candidate scoring and the official metric, on
hand-made records."""

import json

import pytest
import torch

from mhe.data.record_reader import parse_record, read_record
from mhe.data.tokenize import train_tokenizer
from mhe.errors import MheError
from mhe.metrics.record_scores import record_scores
from mhe.models import build_model
from mhe.tasks.record_candidates import classifier_scorer, predict_record

TEXT = "Paris (CNN) -- The Eiffel Tower in Paris drew record crowds.\n@highlight\nGustave Eiffel built it"


def span(text, word, nth=0):
    start = -1
    for _ in range(nth + 1):
        start = text.index(word, start + 1)
    return {"start": start, "end": start + len(word) - 1}  # inclusive end, as in the official files


RECORD = {"idx": 7, "source": "Daily mail", "passage": {
    "text": TEXT,
    "entities": [span(TEXT, "Paris"), span(TEXT, "CNN"), span(TEXT, "Eiffel Tower"), span(TEXT, "Paris", 1),
                 span(TEXT, "Gustave Eiffel")]},
    "qas": [{"idx": 70, "query": "@placeholder designed the tower.",
             "answers": [{**span(TEXT, "Gustave Eiffel"), "text": "Gustave Eiffel"}]},
            {"idx": 71, "query": "Crowds went to @placeholder.",
             "answers": [{**span(TEXT, "Eiffel Tower"), "text": "Eiffel Tower"},
                         {**span(TEXT, "Paris"), "text": "Paris"}]}]}


def test_reader_takes_the_official_format(tmp_path):
    path = tmp_path / "superglue" / "ReCoRD" / "val.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(RECORD) + "\n")
    qs = read_record("dev", data_dir=tmp_path)
    assert [q.uid for q in qs] == ["70", "71"]
    assert qs[0].candidates == ["Paris", "CNN", "Eiffel Tower", "Gustave Eiffel"]  # distinct, first mention first
    assert qs[1].answers == ["Eiffel Tower", "Paris"]
    assert "@highlight" not in qs[0].passage and "- Gustave Eiffel" in qs[0].passage
    assert qs[0].filled("CNN") == "CNN designed the tower."


def test_missing_data_and_bad_records_say_so(tmp_path):
    with pytest.raises(MheError, match="ReCoRD dev data is not offline"):
        read_record("dev", data_dir=tmp_path)
    with pytest.raises(MheError, match="record 1: not an official ReCoRD record"):
        parse_record(json.dumps({"passage": {"text": "x"}}))
    bad = {**RECORD, "qas": [{"idx": 1, "query": "no slot", "answers": []}]}
    with pytest.raises(MheError, match="has no @placeholder"):
        parse_record(json.dumps(bad))


def test_candidate_scoring_picks_the_best_entity():
    qs = parse_record(json.dumps(RECORD))
    seen = []

    def score(pairs):  # prefers longer filled queries, except anything with "CNN"
        seen.extend(pairs)
        return [-1.0 if "CNN" in q else float(len(q)) for _, q in pairs]

    pred = predict_record(qs, score)
    assert pred == {"70": "Gustave Eiffel", "71": "Gustave Eiffel"}
    assert len(seen) == 8 and seen[0] == (qs[0].passage, "Paris designed the tower.")
    r = record_scores(pred, {q.uid: q.answers for q in qs})
    assert r["exact_match"] == 50.0 and r["f1"] == pytest.approx(100 * (1 + 2 * 0.5 * 0.5 / 1.0) / 2)


def test_official_metric_by_hand():
    golds = {"a": ["The Eiffel Tower", "Eiffel"], "b": ["Paris"], "c": ["New York City"], "d": ["x"]}
    preds = {"a": "eiffel tower!", "b": "London", "c": "York"}  # d unanswered: 0
    r = record_scores(preds, golds)
    assert r["exact_match"] == 25.0 and r["total"] == 4
    assert r["f1"] == pytest.approx(100 * (1 + 0 + 2 * 1 * (1 / 3) / (1 + 1 / 3) + 0) / 4)
    assert record_scores({"q": ""}, {"q": ["."]})["f1"] == 0.0  # nothing shared: 0, as in SQuAD v1.1


def test_classifier_scorer_is_the_models_log_probability():
    qs = parse_record(json.dumps(RECORD))
    tok = train_tokenizer("wordpiece", [TEXT, "designed the tower crowds went to"] * 5, 200)
    model = build_model("tiny-encoder", head="classification", vocab_size=tok.get_vocab_size(), d_model=32,
                        n_heads=4, d_ff=64, n_layers=1, max_len=64).double().eval()
    scores = classifier_scorer(model, tok, batch_size=3)([(qs[0].passage, qs[0].filled(c)) for c in qs[0].candidates])
    from mhe.data.tokenize import with_pair_template
    from tokenizers import Tokenizer

    pair_tok = with_pair_template(Tokenizer.from_str(tok.to_str()))
    for c, s in zip(qs[0].candidates, scores):
        e = pair_tok.encode(qs[0].passage, qs[0].filled(c))
        ids, types = torch.tensor([e.ids]), torch.tensor([e.type_ids])
        with torch.no_grad():
            want = torch.log_softmax(model(ids, None, types).logits, -1)[0, 1]
        assert s == pytest.approx(float(want), rel=1e-12)
    assert len(set(scores)) > 1
