"""The training losses, written once: every model head, the Hugging Face adapter and the
tasks compute their losses here. Logits are upcast to float32 first, so a bf16/fp16 forward
pass still gets a float32 log-softmax; label ``IGNORE`` (-100, PyTorch's and Hugging Face's
convention) marks positions that are not scored.

:func:`head_loss` scores hidden states through a model's output layer chunk by chunk
(:func:`linear_cross_entropy`), never materialising the float32 ``[N, V]`` logits; models use
it where :func:`chunked_loss_wanted` says so (a precision below float32: bf16 autocast, the
GPU default), and the plain :func:`token_loss` of their logits in float32, so float32 (CPU)
results stay bit-identical to the unchunked computation. A caller may choose either way with
the models' ``chunked_loss`` argument (the trainer's compiled step of varying batch shapes asks
for the plain loss: :attr:`~mhe.training.step.StepModule.chunked_loss`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

IGNORE = -100  # label of a position that is not scored (padding, unmasked MLM tokens)
CHUNK_BYTES = 2 ** 28  # scores of one chunk of rows, in the matrix products' dtype: 256 MiB


def token_loss(logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float = 0.0,
               num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of every scored position (masked LM, sequence-to-sequence).

    Args:
        logits: ``[..., V]`` scores over the vocabulary.
        labels: ``[...]`` target ids, ``IGNORE`` where not scored.
        label_smoothing: Szegedy et al. (2016) smoothing, 0.1 for translation (Vaswani et al. 2017).
        num_items: divide the summed loss by this count instead of the number of scored positions
            (Hugging Face's ``num_items_in_batch``: gradient accumulation then averages over
            tokens, not over micro-batches).
    """
    flat = logits.flatten(0, -2).float()  # [N, V]
    target = labels.flatten()  # [N]
    if num_items is None:
        return F.cross_entropy(flat, target, ignore_index=IGNORE, label_smoothing=label_smoothing)
    return F.cross_entropy(flat, target, ignore_index=IGNORE, label_smoothing=label_smoothing,
                           reduction="sum") / num_items


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *,
                   num_items: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token loss: position t's logits ``[B, T, V]`` are scored on label t+1 (``labels`` are
    the inputs themselves, ``[B, T]``); see :func:`token_loss` for ``num_items``."""
    return token_loss(logits[:, :-1], labels[:, 1:], num_items=num_items)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, num_labels: int) -> torch.Tensor:
    """Cross-entropy over ``[B, num_labels]`` classes; mean squared error when ``num_labels == 1``
    (STS-B's regression)."""
    if num_labels == 1:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.float(), labels)


def span_loss(logits: torch.Tensor, start_positions: torch.Tensor, end_positions: torch.Tensor) -> torch.Tensor:
    """Extractive QA (SQuAD; Devlin et al. 2019, section 4.2): the mean of the start and the end
    cross-entropies over the ``[B, T, 2]`` span logits."""
    start, end = logits.float().unbind(-1)  # [B, T] each
    return (F.cross_entropy(start, start_positions) + F.cross_entropy(end, end_positions)) / 2


def chunked_loss_wanted(hidden: torch.Tensor, weight: torch.Tensor, chunked: bool | None = None) -> bool:
    """Whether a model scores ``hidden`` through its output layer with :func:`head_loss` (the
    scores would be computed below float32 precision: bf16 autocast, the GPU default) or with
    the plain :func:`token_loss` of its logits (float32: bit-identical to earlier releases).
    ``chunked``: the caller's choice (the models' ``chunked_loss`` argument); None: by precision."""
    return chunked if chunked is not None else _compute_dtype(hidden, weight).itemsize < 4


def head_loss(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, *, vocab_size: int,
              label_smoothing: float = 0.0) -> torch.Tensor:
    """:func:`token_loss` of ``head(hidden)`` over its first ``vocab_size`` outputs (the layer may
    hold padding rows, :mod:`mhe.models.vocab_padding`), by :func:`linear_cross_entropy`."""
    return linear_cross_entropy(hidden, head.weight, head.bias, labels, vocab_size=vocab_size,
                                label_smoothing=label_smoothing)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         labels: torch.Tensor, *, vocab_size: int, label_smoothing: float = 0.0,
                         num_items: int | torch.Tensor | None = None, chunk_rows: int | None = None) -> torch.Tensor:
    """:func:`token_loss` of the logits ``hidden @ weight.T + bias`` restricted to the first
    ``vocab_size`` columns, computed ``chunk_rows`` rows at a time: each chunk's scores are
    made, turned into the loss and into the gradients of ``hidden``, ``weight`` and ``bias``
    (softmax minus the smoothed one-hot target, Szegedy et al. 2016), then freed. Only one
    chunk's scores exist at once (as the matrix product gives them; loss and gradient are
    computed from them in float32); the backward pass only scales the stored gradients (the
    loss is a scalar). The matrix products run in the autocast dtype, as the
    plain ``head(hidden)`` would; rows of ``weight`` past ``vocab_size`` (padding) get no score.

    Args:
        hidden: ``[..., m]``; weight: ``[V_pad, m]``; bias: ``[V_pad]`` or None; labels: ``[...]``.
        chunk_rows: rows per chunk (default: 256 MiB of scores in the products' dtype: in bf16
            twice the rows of float32, so half as many passes adding a chunk's ``weight``
            gradient to the float32 sum).

    The loop over the chunks makes ``torch.compile`` specialise on the number of rows (dynamo
    shows a dynamic size to Python as an int), so a compiled step whose batches change shape
    would be compiled again for every shape: the trainer scores those with the plain loss
    (:attr:`~mhe.training.step.StepModule.chunked_loss`).
    """
    flat, target = hidden.flatten(0, -2), labels.flatten()  # [N, m], [N]
    divisor = (target != IGNORE).sum() if num_items is None else num_items
    dtype = _compute_dtype(hidden, weight)
    rows = chunk_rows or max(1, CHUNK_BYTES // (dtype.itemsize * weight.shape[0]))
    grads = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(flat, weight, bias, target, divisor, vocab_size, float(label_smoothing),
                                     rows, dtype, grads)


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, divisor, vocab, eps, rows, dtype, grads):
        acc = torch.promote_types(dtype, torch.float32)
        with torch.autocast(hidden.device.type, enabled=False):
            w, b = weight.to(dtype), None if bias is None else bias.to(acc)
            cols = torch.arange(weight.shape[0], device=hidden.device)  # [V_pad]
            total = hidden.new_zeros((), dtype=acc)
            gh = torch.empty_like(hidden) if grads else None
            gw = torch.zeros_like(weight, dtype=acc) if grads else None
            gb = torch.zeros_like(bias, dtype=acc) if grads and bias is not None else None
            for s in range(0, hidden.shape[0], rows):
                h = hidden[s:s + rows].to(dtype)
                loss, g = _chunk_loss(h @ w.t(), b, target[s:s + rows], cols, vocab=vocab, eps=eps, acc=acc,
                                      divisor=divisor if grads else None)
                total = total + loss
                if grads:
                    g = g.to(dtype)  # d loss / d scores, in the matrix products' dtype
                    gh[s:s + rows] = (g @ w).to(hidden.dtype)
                    gw.add_(g.t() @ h)
                    if gb is not None:
                        gb.add_(g.sum(0))
        if grads:
            ctx.save_for_backward(gh, gw, gb)
            ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        return total / divisor

    @staticmethod
    def backward(ctx, grad):
        gh, gw, gb = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        return (gh * grad.to(gh.dtype), (gw * grad).to(w_dtype), None if gb is None else (gb * grad).to(b_dtype),
                None, None, None, None, None, None, None)


def _chunk_loss(scores, bias, y, cols, *, vocab, eps, acc, divisor):
    """One chunk's summed loss and, when ``divisor`` is given, its gradient with respect to the
    scores ``[n, V_pad]`` (softmax minus the smoothed one-hot target, over ``divisor``; 0 on the
    padding columns), in ``acc`` precision.

    Every step is an elementwise expression of the scores or a reduction along their rows, none
    in place, so that ``torch.compile`` fuses them into one reduction and one elementwise pass
    over the chunk's scores as the matrix product left them (no float32 copy is materialised);
    eagerly the values are the same, bit for bit, as filling the padding with -inf in place and
    scatter-adding the target's -(1 - eps)."""
    z = scores.to(acc)  # [n, V_pad]
    if bias is not None:
        z = z + bias
    z = z.masked_fill(cols >= vocab, float("-inf"))  # padding rows: never a score
    lse = z.logsumexp(-1)  # [n]
    keep = y != IGNORE
    safe = torch.where(keep, y, 0)[:, None]  # [n, 1]
    row = lse - (1 - eps) * z.gather(1, safe).squeeze(1)
    if eps:
        row = row - eps * z[:, :vocab].sum(-1) / vocab
    loss = torch.where(keep, row, 0).sum()
    if divisor is None:
        return loss, None
    p = (z - lse[:, None]).exp()  # softmax [n, V_pad]; 0 on the padding
    g = torch.where(cols == safe, p - (1 - eps), p)
    if eps:
        g = g - (cols < vocab).to(acc) * (eps / vocab)
    return loss, g * (keep.to(acc) / divisor)[:, None]
