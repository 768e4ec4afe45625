"""One matrix product for a self-attention sublayer's queries, keys and values, at inference.

A decode step at batch 1 is bound by how many kernels it launches, not by the bytes it reads
(docs/benchmarks.md section 9: about 3 us a kernel, 188 kernels a gpt2-base token). Three
projections of the same input are three matrix products; their weights stacked row-wise,
``[W^Q; W^K; W^V]: [(h_q + 2 h_kv) d, m]``, give the same outputs in one, as GPT-2's own
``c_attn`` and gpt-fast's ``wqkv`` do. :func:`fuse_projections` gives each sublayer that can
(:meth:`~mhe.attention.base.Attention.projections_to_fuse`) that stacked copy as ``qkv_proj``,
and its ``_self_projections`` then splits the one output.

The stacked weights are a copy: they do not follow later changes of the sublayer's own
projections, so only an inference view gets them (the generator's, rebuilt whenever the
model's weights change: :class:`~mhe.models.generate.Generator`), never a model that trains.
The copy costs the memory of the stacked projections while a session holds its view: for MHA
the whole of W^Q, W^K and W^V (three quarters of each layer's attention weights) again, per
session (a model keeps up to two default sessions); for a folded MHE sublayer little more
than the folded query weight its view holds anyway (its K and V are one head each). Weights
written through ``.data`` change no version counter, and the copy would not see them.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention.base import Attention

FUSED = "qkv_proj"
"""The attribute a fused sublayer holds its stacked projection in."""


def fused_projection(module: Attention) -> nn.Linear | None:
    """The sublayer's stacked query/key/value projection, None when it has none."""
    return module._modules.get(FUSED)


@torch.no_grad()
def stack_linears(parts: tuple[nn.Linear, ...]) -> nn.Linear:
    """One ``nn.Linear`` computing ``torch.cat([p(x) for p in parts], -1)`` (weights copied, frozen)."""
    first = parts[0]
    weight = torch.cat([p.weight for p in parts], 0)  # [sum of outputs, m]
    biased = any(p.bias is not None for p in parts)
    bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features) for p in parts]) \
        if biased else None
    with torch.device("meta"):  # shapes only; the weights are set below
        out = nn.Linear(first.in_features, weight.shape[0], bias=biased)
    out.weight = nn.Parameter(weight, requires_grad=False)
    out.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return out


def fuse_projections(module: nn.Module) -> nn.Module:
    """Give every attention sublayer of ``module`` (in place) whose kind can compute its
    self-attention queries, keys and values in one product a stacked copy of those projections
    (see the module docstring); returns ``module``. Same function, fewer kernels."""
    for m in module.modules():
        if isinstance(m, Attention) and fused_projection(m) is None:
            parts = m.projections_to_fuse()
            if parts:
                setattr(m, FUSED, stack_linears(parts))
    return module
