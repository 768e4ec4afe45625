"""One matrix product for the projections of one input, at inference: a self-attention
sublayer's queries, keys and values, and a gated feed-forward's gate and up projections.

A decode step at batch 1 is bound by how many kernels it launches, not by the bytes it reads
(docs/benchmarks.md section 9: about 3 us a kernel, 188 kernels a gpt2-base token). Projections
of the same input are separate matrix products; their weights stacked row-wise, e.g.
``[W^Q; W^K; W^V]: [(h_q + 2 h_kv) d, m]``, give the same outputs in one, as GPT-2's own
``c_attn`` and gpt-fast's ``wqkv`` (and its feed-forward's ``w1``/``w3`` pair) do. A module that can
(:meth:`~mhe.attention.base.Attention.projections_to_fuse`, and the same method on a gated
feed-forward such as :class:`~mhe.models.layers.SwiGLU`) gets from :func:`fuse_projections` that
stacked copy as ``fused_proj``, and its forward then splits the one output.

The stacked weights are a copy: they do not follow later changes of the module's own
projections, so only an inference view gets them (the generator's, rebuilt whenever the
model's weights change: :class:`~mhe.generation.session.Generator`), never a model that trains.
The copy costs the memory of the stacked projections while a session holds its view: for MHA
the whole of W^Q, W^K and W^V (three quarters of each layer's attention weights) again, per
session (a model keeps up to two default sessions); for a folded MHE sublayer little more
than the folded query weight its view holds anyway (its K and V are one head each); for a gated
feed-forward its gate and up weights (stacked only while each is small enough for a one-row
product to be bound by its launch: :data:`mhe.models.layers.FUSE_MAX_BYTES`). Weights written
through ``.data`` change no version counter, and the copy would not see them.

MHE under rotary positions multiplies its one rotated query by per-head factors built from the
head embeddings (MHE-Mul: ``(1 + e^Q_i)(1 + e^K_i)``; :mod:`mhe.attention.mhe`). They are
constant while a view decodes, yet a step would build them again from the embeddings every time
(a kernel a layer, docs/benchmarks.md section 12, "Batch 1, profiled"): the view keeps them made
once, as ``fused_query_factors`` (a buffer outside the state dict, computed as the step would).
Its output projection is folded the same way every step (MHE-Mul scales the columns of W^O by
``1 + e^V``, a weight-sized elementwise kernel a layer that reads and writes all of W^O; MHE-Add
adds ``W^O e^V`` to the bias, a product and a sum a layer): the view keeps the folded weight and
bias too, as ``fused_out_weight`` and ``fused_out_bias`` (MHE-Mul's costs W^O's memory again while a
session holds its view; MHE-Add's weight is W^O's own tensor). They are made in the module's own
dtype with autocast off and of elementwise products and sums only (no matrix product: a TF32
setting cannot round them), since a session built under one setting is reused under another;
the process-wide matrix-product precision is neither read nor set (reading it raises once a
caller used torch's newer per-backend setting). Like the stacked copy, they do not see writes
through ``.data`` to the head embeddings or to W^O.
"""

from __future__ import annotations

import torch
from torch import nn


FUSED = "fused_proj"
"""The attribute a fused module holds its stacked projection in."""
FACTORS = "fused_query_factors"
"""The buffer an MHE sublayer's view holds its per-head query factors in (see :func:`fuse_projections`)."""
OUT_WEIGHT, OUT_BIAS = "fused_out_weight", "fused_out_bias"
"""The buffers an MHE sublayer's view holds its folded output weight and bias in."""


def fused_projection(module: nn.Module) -> nn.Linear | None:
    """The module's stacked projection (queries/keys/values, or gate/up), None when it has none."""
    return module._modules.get(FUSED)


def fused_factors(module: nn.Module) -> torch.Tensor | None:
    """The module's per-head query factors made once for its view, None when it has none."""
    return module._buffers.get(FACTORS)


def fused_output(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The module's folded output weight and bias (None: no bias) made once for its view, None
    when it keeps none."""
    if OUT_WEIGHT not in module._buffers:
        return None
    return module._buffers[OUT_WEIGHT], module._buffers[OUT_BIAS]


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
    """Give every module of ``module`` (in place) that can compute several projections of one
    input in one product (``projections_to_fuse``: an attention sublayer whose kind can, a gated
    feed-forward) a stacked copy of those projections (see the module docstring); returns
    ``module``. Same function, fewer kernels."""
    for m in module.modules():
        wants = getattr(m, "projections_to_fuse", None)
        if callable(wants) and fused_projection(m) is None:
            parts = wants()
            if parts:
                setattr(m, FUSED, stack_linears(parts))
        _keep_folded(m)
    return module


def _keep_folded(m: nn.Module) -> None:
    """An MHE sublayer's per-head query factors and folded output weight and bias, made once as
    buffers outside the state dict (see the module docstring); other modules are left alone."""
    factors, output = getattr(m, "query_factors_to_keep", None), getattr(m, "output_to_keep", None)
    if not callable(factors) and not callable(output):
        return
    with torch.no_grad(), torch.autocast(next(m.parameters()).device.type, enabled=False):
        f = factors() if callable(factors) and fused_factors(m) is None else None
        folded = output() if callable(output) and fused_output(m) is None else None
    if f is not None:
        m.register_buffer(FACTORS, f.detach().clone(), persistent=False)
    if folded is not None:
        weight, bias = folded
        m.register_buffer(OUT_WEIGHT, weight.detach(), persistent=False)  # MHE-Add's: W^O itself, no copy
        m.register_buffer(OUT_BIAS, None if bias is None else bias.detach(), persistent=False)

