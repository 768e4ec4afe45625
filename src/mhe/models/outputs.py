"""What every model returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhe.attention.masks import as_bool_mask  # noqa: F401  (models and their callers import it here)


@dataclass
class ModelOutput:
    """``logits`` of the head; ``loss`` when labels were given; ``hidden`` the last hidden states."""

    logits: torch.Tensor
    loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None
