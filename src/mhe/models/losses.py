"""The training losses, written once: every model head, the Hugging Face adapter and the
tasks compute their losses here. Logits are upcast to float32 first, so a bf16/fp16 forward
pass still gets a float32 log-softmax; label ``IGNORE`` (-100, PyTorch's and Hugging Face's
convention) marks positions that are not scored."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100  # label of a position that is not scored (padding, unmasked MLM tokens)


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
