"""The per-position layers of a block: its normalisation and its feed-forward network.

* :class:`FeedForward`: two linear layers with biases and an activation between them
  (Vaswani et al. 2017, Eq. 2; BERT, GPT-2), ``model.mlp = "plain"``;
* :class:`SwiGLU`: the gated feed-forward of Shazeer (2020, "GLU Variants Improve
  Transformer", Eq. 6: FFN_SwiGLU(x) = (Swish(x W) * x V) W_2) without biases, as Llama,
  Qwen2 and Mistral use it, ``model.mlp = "swiglu"``: three ``m x d_ff`` matrices;
* :class:`RMSNorm`: root-mean-square normalisation (Zhang & Sennrich 2019, Eq. 4) with a
  learned gain and no bias or centring, ``model.norm = "rmsnorm"``; else ``nn.LayerNorm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mhe.attention.fused_projections import fused_projection


FUSE_MAX_BYTES = 16 * 2 ** 20
"""The largest gate or up weight a gated feed-forward stacks at inference. A one-row product of
16 MiB takes about 4 us at an H200's 4 TB/s, about one kernel's launch (docs/benchmarks.md
section 12): below it, one product for both halves the launches that bound a batch-1 step;
above it the product is bound by its bytes, and the stacked copy would add their size again to
every generation session (an 8B Llama's gate and up: 7.5 GB in bf16)."""


def activation(name: str) -> nn.Module:
    """The feed-forward non-linearity ``name`` of :data:`mhe.models.config.ACTIVATIONS`."""
    if name == "relu":
        return nn.ReLU()
    return nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """Position-wise feed-forward network (Vaswani et al. 2017, Eq. 2), with ``cfg.activation``:
    exact GELU (BERT), tanh GELU (GPT-2) or ReLU (Transformer)."""

    def __init__(self, cfg) -> None:
        super().__init__()
        self.fc_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc_out = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = activation(cfg.activation)
        self.drop = nn.Dropout(cfg.dropout)

    @property
    def out_layer(self) -> nn.Linear:
        """The layer that writes into the residual stream (GPT-2 scales its initialisation)."""
        return self.fc_out

    def forward(self, x):
        return self.fc_out(self.drop(self.act(self.fc_in(x))))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases (Shazeer 2020, Eq. 6; Llama's MLP).

    Parameters: 3 * m * d_ff (``gate`` and ``up``: m -> d_ff; ``down``: d_ff -> m).
    """

    def __init__(self, cfg) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    @property
    def out_layer(self) -> nn.Linear:
        return self.down

    def projections_to_fuse(self) -> tuple[nn.Linear, ...]:
        """``gate`` and ``up``, which read the same input: one product at inference
        (:func:`~mhe.attention.fused_projections.fuse_projections`), where each is small enough
        that one row's product is bound by its launch, not its bytes (at most
        :data:`FUSE_MAX_BYTES`); a larger pair stays two products and costs no stacked copy."""
        if max(p.weight.numel() * p.weight.element_size() for p in (self.gate, self.up)) > FUSE_MAX_BYTES:
            return ()
        return self.gate, self.up

    def forward(self, x):
        fused = fused_projection(self)
        gate, up = fused(x).chunk(2, -1) if fused is not None else (self.gate(x), self.up(x))
        return self.down(self.drop(F.silu(gate) * up))


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * g`` over the last dimension (Zhang & Sennrich 2019, Eq. 4).

    The statistic is computed in at least float32 (bf16/fp16 activations are upcast, as Llama's
    code does) and the gain multiplies the result cast back to the input dtype; float64 stays
    float64.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def build_norm(cfg) -> nn.Module:
    """The normalisation ``cfg.norm`` names, with ``cfg.layer_norm_eps``."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps)


def build_mlp(cfg) -> nn.Module | None:
    """The feed-forward network ``cfg.mlp`` names; None for ``none`` (attention-only blocks)."""
    if cfg.mlp == "none":
        return None
    return SwiGLU(cfg) if cfg.mlp == "swiglu" else FeedForward(cfg)
