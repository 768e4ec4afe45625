"""What every model returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ModelOutput:
    """``logits`` of the head; ``loss`` when labels were given; ``hidden`` the last hidden states."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


def as_bool_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Accept 0/1 integer masks as well as boolean ones (True = real token)."""
    if mask is None:
        return None
    return mask if mask.dtype == torch.bool else mask != 0
