"""The one set of losses (mhe.models.losses) against hand-written float64 references."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mhe.models.losses import (IGNORE, causal_lm_loss, classification_loss, linear_cross_entropy,
                               span_loss, token_loss)


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


# ---------------------------------------------------------------- the chunked loss of an output layer
def _plain_head_loss(h, w, b, labels, vocab, eps=0.0, num_items=None):
    """The loss as it was always computed: the full logits over the real vocabulary, then token_loss."""
    logits = h @ w[:vocab].T + (0 if b is None else b[:vocab])
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE, label_smoothing=eps,
                           reduction="mean" if num_items is None else "sum") / (1 if num_items is None else num_items)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("num_items", [None, 7])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_cross_entropy_equals_the_plain_loss_and_gradients(eps, num_items, bias):
    """Padded vocabulary (99 real of 128 rows), ignored labels, label smoothing, a divisor, chunks
    of 4 rows that do not divide the 14 positions; float64, agreement to rounding."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(2, 7, 32, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(128, 32, generator=g, dtype=torch.float64)
    w[99:] = 0
    w.requires_grad_()
    b = torch.randn(128, generator=g, dtype=torch.float64) if bias else None
    if bias:
        b[99:] = 0
        b.requires_grad_()
    labels = torch.randint(0, 99, (2, 7), generator=g)
    labels[0, 3] = labels[1, 0] = IGNORE
    want = _plain_head_loss(h, w, b, labels, 99, eps, num_items)
    got = linear_cross_entropy(h, w, b, labels, vocab_size=99, label_smoothing=eps, num_items=num_items,
                               chunk_rows=4)
    torch.testing.assert_close(got, want, rtol=1e-13, atol=0)
    params = [h, w] + ([b] if bias else [])
    grads = torch.autograd.grad(got, params)
    for gw, gg in zip(torch.autograd.grad(want, params), grads):
        torch.testing.assert_close(gg, gw, rtol=1e-12, atol=1e-15)
    assert not grads[1][99:].any()  # the padding rows get no gradient


def test_chunked_cross_entropy_scores_no_padding_row():
    """A large weight in a padding row would dominate the softmax if it were scored."""
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(5, 8, generator=g, dtype=torch.float64), torch.randn(70, 8, generator=g, dtype=torch.float64)
    w[64:] = 100.0
    labels = torch.randint(0, 64, (5,), generator=g)
    got = linear_cross_entropy(h, w, None, labels, vocab_size=64, chunk_rows=2)
    torch.testing.assert_close(got, _plain_head_loss(h, w, None, labels, 64), rtol=1e-13, atol=0)


def test_chunked_cross_entropy_in_bf16_matches_the_plain_bf16_loss():
    """Under autocast the scores come from a bf16 product, as the plain head's do: the chunked
    loss's error against float64 stays within 2x the plain bf16 loss's (flash-attention's rule)."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(2, 7, 32, generator=g), torch.randn(128, 32, generator=g) * 0.2
    labels = torch.randint(0, 128, (2, 7), generator=g)
    exact = _plain_head_loss(h.double(), w.double(), None, labels, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy((h @ w.T).float().flatten(0, 1), labels.flatten())
        chunked = linear_cross_entropy(h, w, None, labels, vocab_size=128, chunk_rows=3)
    assert chunked.dtype == torch.float32
    assert abs(chunked.double() - exact) <= 2 * abs(plain.double() - exact) + 1e-6


def test_models_score_the_same_with_the_chunked_loss():
    """Each model's training loss through head_loss (chunked, padded vocabulary) equals the float64
    cross-entropy of its own logits, with gradients: causal LM, masked LM on the masked rows only,
    translation with label smoothing."""
    from mhe.models import build_model
    from mhe.models.vocab_padding import pad_vocabulary

    ids = torch.randint(0, 99, (2, 7))
    labels = torch.where(torch.rand(2, 7) < 0.5, ids, IGNORE)
    labels[0, 0] = ids[0, 0]
    pos = (labels.flatten() != IGNORE).nonzero().squeeze(1)
    ce = lambda logits, y, eps=0.0: F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=IGNORE,  # noqa: E731
                                                     label_smoothing=eps)
    runs = {  # (the training loss, the float64 loss of the logits)
        "tiny-decoder": (lambda m: m(ids, labels=ids, return_logits=False, chunked_loss=True).loss,
                         lambda m: ce(m(ids).logits[:, :-1], ids[:, 1:])),
        "tiny-encoder": (lambda m: m(ids, labels=labels, masked_positions=pos, chunked_loss=True).loss,
                         lambda m: ce(m(ids).logits, labels)),
        "tiny-encoder-decoder": (lambda m: m(ids, ids, labels=labels, label_smoothing=0.1, return_logits=False,
                                             chunked_loss=True).loss,
                                 lambda m: ce(m(ids, ids).logits, labels, 0.1)),
    }
    for name, (loss_of, reference) in runs.items():
        model = build_model(name, vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=1, dropout=0.0,
                            attn_dropout=0.0).double()
        want = reference(model)
        grads_want = torch.autograd.grad(want, list(model.parameters()))
        assert pad_vocabulary(model) == 128
        got = loss_of(model)
        grads = torch.autograd.grad(got, list(model.parameters()))
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0, msg=name)
        for (n, p), gw, gg in zip(model.named_parameters(), grads_want, grads):
            torch.testing.assert_close(gg[: gw.shape[0]], gw, rtol=1e-9, atol=1e-13, msg=lambda m: f"{name} {n}: {m}")
            assert not gg[gw.shape[0]:].any()  # padding rows: no gradient



def test_a_compiled_translation_step_compiles_once_for_every_batch_shape():
    """Translation batches change shape every step. The trainer's compiled step scores them with
    the plain loss (StepModule's loss choice; test_training_step_module below): the chunked loss
    loops over the rows and made dynamo compile the whole step again for every batch shape until
    it gave up (minutes per shape on a GPU). Two graphs at most: the first, static, and the dynamic
    one that serves every later shape; losses equal the eager model's."""
    from mhe.models import build_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = build_model("tiny-encoder-decoder", attention="mha", dropout=0.0, attn_dropout=0.0)
    from torch._dynamo.utils import counters

    from mhe.training.config import TrainConfig
    from mhe.training.distributed import Dist
    from mhe.training.parallelize import parallelize

    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")  # AOTAutograd traces the loss's own backward, as inductor
    trainer_step = parallelize(model, TrainConfig(compile=True), Dist(), static_shapes=False, note=print).step
    assert trainer_step.chunked_loss is False
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16: chunked by default
        for src_len, tgt_len in ((7, 5), (9, 6), (12, 4), (5, 11), (8, 8)):
            src, tgt = torch.randint(3, 500, (3, src_len)), torch.randint(3, 500, (3, tgt_len))
            got = compiled(src, tgt, labels=tgt, return_logits=False,  # as the trainer calls it
                           chunked_loss=trainer_step.chunked_loss).loss
            got.backward()
            want = model(src, tgt, labels=tgt, return_logits=False).loss
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert counters["stats"]["unique_graphs"] <= 2  # the chunked loss made one per shape (5)


def test_training_step_module_scores_varying_shapes_with_the_plain_loss_when_compiled():
    """The step passes its task's loss ``chunked_loss=False`` only where the step is compiled whole
    and its batches change shape; the chunked loss (by precision) everywhere else."""
    from mhe.training.config import TrainConfig
    from mhe.training.distributed import Dist
    from mhe.training.parallelize import parallelize

    model = torch.nn.Linear(2, 2)

    def step(compiled, static, module=model):
        return parallelize(module, TrainConfig(compile=compiled), Dist(), static_shapes=static, note=print).step

    seen = [step(compiled, static).chunked_loss for compiled, static in ((True, False), (True, True), (False, False))]
    assert seen == [False, None, None]  # only a compiled step of varying shapes leaves the chunked loss
    fsdp = step(True, False, torch.nn.Sequential())
    fsdp.blocks = [(model, model.forward)]  # FSDP compiles the blocks only: head and loss run eagerly
    fallen = step(True, False)
    fallen.eager_fallback = True
    assert fsdp.chunked_loss is None and fallen.chunked_loss is None  # neither compiles the loss
