"""ReCoRD by entity-candidate scoring: each candidate entity is put in place of
``@placeholder`` and the (passage, filled query) pair is scored; the prediction is the text
of the best-scoring candidate (the first on ties), as in the SuperGLUE BERT baseline."""

from __future__ import annotations

from typing import Callable

import torch
from tokenizers import Tokenizer

from mhe.data.record_reader import RecordQuery
from mhe.data.tokenize import special_id, with_pair_template
from mhe.errors import MheError
from mhe.tasks.text import pad_rows

Scorer = Callable[[list[tuple[str, str]]], list[float]]


def predict_record(queries: list[RecordQuery], score: Scorer) -> dict[str, str]:
    """Query id -> the best-scoring candidate's text. ``score`` maps (passage, filled query)
    pairs to one number each (higher: more likely the answer)."""
    pairs, owner = [], []
    for i, q in enumerate(queries):
        if not q.candidates:
            raise MheError(f"ReCoRD query {q.uid} has no candidate entities")
        pairs.extend((q.passage, q.filled(c)) for c in q.candidates)
        owner.extend([i] * len(q.candidates))
    scores = list(score(pairs))
    if len(scores) != len(pairs):
        raise MheError(f"the scorer returned {len(scores)} scores for {len(pairs)} candidates")
    best: dict[int, tuple[float, str]] = {}
    k = 0
    for i, q in enumerate(queries):
        for c in q.candidates:
            if i not in best or scores[k] > best[i][0]:
                best[i] = (scores[k], c)
            k += 1
    return {q.uid: best[i][1] for i, q in enumerate(queries)}


def classifier_scorer(model, tokenizer, *, batch_size: int = 32, max_len: int | None = None) -> Scorer:
    """A scorer from an encoder classification model (``[CLS] passage [SEP] query [SEP]``,
    truncated longest-first): the log-probability of label 1 ("the entity fits"), or the
    logit itself for a one-label (regression) head."""
    if getattr(model.cfg, "arch", "") != "encoder" or model.cfg.head != "classification":
        raise MheError("ReCoRD candidate scoring needs an encoder with a classification head")
    tok = with_pair_template(Tokenizer.from_str(tokenizer.to_str()))
    tok.enable_truncation(max_len or model.cfg.max_len, strategy="longest_first")
    pad = special_id(tokenizer, "[PAD]")

    @torch.no_grad()
    def score(pairs):
        model.eval()
        dev = next(model.parameters()).device
        out = []
        for k in range(0, len(pairs), batch_size):
            enc = tok.encode_batch(pairs[k:k + batch_size])
            ids = pad_rows([e.ids for e in enc], pad).to(dev)
            types = pad_rows([e.type_ids for e in enc], 0).to(dev)
            logits = model(ids, ids != pad, types).logits.double()  # [b, num_labels]
            s = logits[:, 0] if logits.shape[-1] == 1 else torch.log_softmax(logits, -1)[:, 1]
            out.extend(s.cpu().tolist())
        return out

    return score
