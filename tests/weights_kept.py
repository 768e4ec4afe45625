"""Helpers for the tests that check a function keeps the weights it is given: weights no
initialiser produces, snapshots, and the list of tensors that changed."""

from __future__ import annotations

import torch


def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 1.0) -> torch.nn.Module:
    """Move every parameter (LayerNorm scales and biases, MHE head embeddings, tied weights
    once) by a normal draw of standard deviation ``scale``: values no initialiser produces, as
    training does. The default (1) makes attention scores large and the model chaotic, which exact
    float64 checks want; a bf16 check wants a small ``scale``, where rounding cannot flip a choice."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def snapshot(model_or_state) -> dict[str, torch.Tensor]:
    """A detached copy of a model's state dict (or of a state dict)."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    return {k: v.detach().clone() for k, v in state.items()}


def changed(state: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensor is not bit-equal to ``before`` (or missing on either side)."""
    names = sorted(set(state) | set(before))
    return [k for k in names if k not in state or k not in before or not torch.equal(state[k], before[k])]


def assert_kept(state: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> None:
    """Every tensor bit-equal to ``before`` (same names, dtypes, values)."""
    bad = changed(state, before)
    assert not bad, f"{len(bad)} of {len(before)} tensors changed, e.g. {bad[:4]}"
    assert all(state[k].dtype == before[k].dtype for k in before)
