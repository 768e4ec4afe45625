"""Literal re-statements of the official SQuAD evaluation scripts' logic (v1.1 and v2.0,
Rajpurkar et al. 2016, 2018), written from their published algorithm as step-by-step
references for tests. They read the official nested dataset format."""

from __future__ import annotations

import collections
import re
import string


def normalize(s):
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


# ------------------------------------------------------------------ v1.1
def v11_f1(prediction, ground_truth):
    prediction_tokens = normalize(prediction).split()
    ground_truth_tokens = normalize(ground_truth).split()
    common = collections.Counter(prediction_tokens) & collections.Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def v11_em(prediction, ground_truth):
    return normalize(prediction) == normalize(ground_truth)


def v11_evaluate(dataset, predictions):
    f1 = exact_match = total = 0
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                if qa["id"] not in predictions:
                    continue
                ground_truths = [a["text"] for a in qa["answers"]]
                prediction = predictions[qa["id"]]
                exact_match += max(v11_em(prediction, gt) for gt in ground_truths)
                f1 += max(v11_f1(prediction, gt) for gt in ground_truths)
    return {"exact_match": 100.0 * exact_match / total, "f1": 100.0 * f1 / total}


# ------------------------------------------------------------------ v2.0
def get_tokens(s):
    if not s:
        return []
    return normalize(s).split()


def v20_exact(a_gold, a_pred):
    return int(normalize(a_gold) == normalize(a_pred))


def v20_f1(a_gold, a_pred):
    gold_toks = get_tokens(a_gold)
    pred_toks = get_tokens(a_pred)
    common = collections.Counter(gold_toks) & collections.Counter(pred_toks)
    num_same = sum(common.values())
    if len(gold_toks) == 0 or len(pred_toks) == 0:
        return int(gold_toks == pred_toks)
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(pred_toks)
    recall = 1.0 * num_same / len(gold_toks)
    return (2 * precision * recall) / (precision + recall)


def v20_evaluate(dataset, preds):
    qid_to_has_ans = {}
    exact_scores, f1_scores = {}, {}
    for article in dataset:
        for p in article["paragraphs"]:
            for qa in p["qas"]:
                qid = qa["id"]
                qid_to_has_ans[qid] = bool(qa["answers"])
                gold_answers = [a["text"] for a in qa["answers"] if normalize(a["text"])]
                if not gold_answers:
                    gold_answers = [""]
                if qid not in preds:
                    continue
                a_pred = preds[qid]
                exact_scores[qid] = max(v20_exact(a, a_pred) for a in gold_answers)
                f1_scores[qid] = max(v20_f1(a, a_pred) for a in gold_answers)

    def make_eval_dict(qid_list=None):
        if not qid_list:
            total = len(exact_scores)
            return {"exact": 100.0 * sum(exact_scores.values()) / total,
                    "f1": 100.0 * sum(f1_scores.values()) / total, "total": total}
        total = len(qid_list)
        return {"exact": 100.0 * sum(exact_scores[k] for k in qid_list) / total,
                "f1": 100.0 * sum(f1_scores[k] for k in qid_list) / total, "total": total}

    out = make_eval_dict()
    has_ans = [k for k, v in qid_to_has_ans.items() if v]
    no_ans = [k for k, v in qid_to_has_ans.items() if not v]
    if has_ans:
        for k, v in make_eval_dict(has_ans).items():
            out[f"HasAns_{k}"] = v
    if no_ans:
        for k, v in make_eval_dict(no_ans).items():
            out[f"NoAns_{k}"] = v
    return out


def as_dataset(golds: dict) -> list:
    """id -> [answer texts] in the official nested format (one article, one paragraph)."""
    return [{"paragraphs": [{"context": "", "qas": [
        {"id": q, "answers": [{"text": a, "answer_start": 0} for a in ans]} for q, ans in golds.items()]}]}]
