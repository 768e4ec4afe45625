"""Activation checkpointing: a block keeps only its input and runs its forward pass again in the
backward pass, trading about one more forward pass of compute for the activation memory.

``train.activation_checkpointing`` (the block is :class:`~mhe.models.blocks.Block`, one
transformer layer: attention, feed-forward, their norms and residuals):

* ``none``: every block keeps its activations (the default);
* ``full``: every block is checkpointed: the activations kept are the blocks' inputs, plus
  one block's intermediates while its backward pass runs; the compute is about one more
  forward pass (about a third more per step);
* ``selective``: every other block (the 1st, 3rd, ...) is checkpointed: about half the
  activation memory of ``none`` for about half the recomputation of ``full`` (torchtitan's
  layer-level selective checkpointing at frequency 2).

The block's ``forward`` is replaced on the instance by a checkpointed call of the same forward
(:func:`torch.utils.checkpoint.checkpoint`, non-reentrant, the random state preserved, so
dropout draws the same masks again), so parameter names, state dicts and checkpoints are those
of the model without it, DDP, FSDP and ``torch.compile`` (which traces the checkpoint as one
region) see the same module, and results are the same: the recomputation repeats the same
operations. Without gradients (evaluation) the block runs its forward once, as without.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mhe.models.blocks import Block

MODES = ("none", "full", "selective")


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer layers of ``model`` in module order (an encoder-decoder: the encoder's,
    then the decoder's): the units activation checkpointing, FSDP and per-block compilation
    work on."""
    return [m for m in model.modules() if isinstance(m, Block)]


def checkpointed_blocks(blocks: list[nn.Module], mode: str) -> list[nn.Module]:
    """Which of ``blocks`` ``mode`` checkpoints (see the module docstring)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}; valid: {', '.join(MODES)}")
    if mode == "none":
        return []
    return list(blocks) if mode == "full" else list(blocks[::2])


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint the blocks ``mode`` names, in place; returns how many. Applying it twice
    checkpoints a block once."""
    chosen = checkpointed_blocks(transformer_blocks(model), mode)
    for block in chosen:
        if not getattr(block, "_checkpointed", False):
            block.forward = functools.partial(_run_checkpointed, block.forward)
            block._checkpointed = True
    return len(chosen)


def _run_checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():  # evaluation: nothing to recompute
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
