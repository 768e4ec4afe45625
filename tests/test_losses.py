"""The one set of losses (mhe.models.losses) against hand-written float64 references."""

from __future__ import annotations

import math

import torch

from mhe.models.losses import IGNORE, causal_lm_loss, classification_loss, span_loss, token_loss


def _nll(logits_row, target) -> float:
    """-log softmax(logits_row)[target], written out."""
    z = max(logits_row)
    return -(logits_row[target] - z - math.log(sum(math.exp(v - z) for v in logits_row)))


def test_causal_lm_loss_scores_position_t_on_token_t_plus_1():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 99, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 99, (2, 7), generator=g)
    labels[0, 3] = IGNORE
    terms = [_nll(logits[b, t].tolist(), int(labels[b, t + 1])) for b in range(2) for t in range(6)
             if labels[b, t + 1] != IGNORE]
    torch.testing.assert_close(causal_lm_loss(logits, labels).double(),
                               torch.tensor(sum(terms) / len(terms), dtype=torch.float64), rtol=1e-6, atol=1e-6)
    # num_items: the sum divided by the given count (gradient accumulation over tokens)
    torch.testing.assert_close(causal_lm_loss(logits, labels, num_items=5).double(),
                               torch.tensor(sum(terms) / 5, dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_token_loss_with_label_smoothing():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([[0, 4, IGNORE], [2, 2, 1]])
    eps, terms = 0.1, []
    for b in range(2):
        for t in range(3):
            if labels[b, t] == IGNORE:
                continue
            row = logits[b, t].tolist()
            uniform = sum(_nll(row, c) for c in range(5)) / 5
            terms.append((1 - eps) * _nll(row, int(labels[b, t])) + eps * uniform)
    torch.testing.assert_close(token_loss(logits, labels, label_smoothing=eps).double(),
                               torch.tensor(sum(terms) / len(terms), dtype=torch.float64), rtol=1e-6, atol=1e-6)


def test_span_and_classification_losses():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 7, 2, generator=g, dtype=torch.float64)
    start, end = torch.tensor([1, 6]), torch.tensor([2, 6])
    ref = sum(_nll(logits[b, :, 0].tolist(), int(start[b])) + _nll(logits[b, :, 1].tolist(), int(end[b]))
              for b in range(2)) / 4
    torch.testing.assert_close(span_loss(logits, start, end).double(), torch.tensor(ref, dtype=torch.float64),
                               rtol=1e-6, atol=1e-6)
    scores, gold = torch.tensor([[0.5], [2.0]]), torch.tensor([1.0, 1.0])
    assert classification_loss(scores, gold, 1).item() == (0.25 + 1.0) / 2  # regression: mean squared error
    classes = torch.tensor([[2.0, 0.0, -1.0]])
    assert math.isclose(classification_loss(classes, torch.tensor([1]), 3).item(), _nll([2.0, 0.0, -1.0], 1),
                        rel_tol=1e-6)
