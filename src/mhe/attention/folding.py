"""Inference-time weight folding: a trained MHE sublayer becomes a plain multi-query one.

Uses the identities in docs/paper-notes.md. MHE-Mul: the query weight of head i
is W^Q scaled by (1+eQ_i)(1+eK_i); the output projection's columns are scaled
by (1+eV). MHE-Add: head i's query bias is eQ_i; the key offsets vanish; the
value offsets become the output bias W^O eV (exact without attention dropout,
i.e. at inference). The folded module is an ``mqa`` sublayer, so generation
uses its one-head KV cache and nothing else changes.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention.mhe import MHEAdd, MHEMul, _MHEBase
from mhe.attention.registry import build_attention


@torch.no_grad()
def fold_mhe(mod: _MHEBase) -> nn.Module:
    """The multi-query sublayer that computes what ``mod`` computes in eval mode."""
    c = mod.cfg
    n, d, m = c.n_heads, c.head_dim, c.d_model
    needs_bias = c.bias or isinstance(mod, MHEAdd)
    mqa = build_attention("mqa", d_model=m, n_heads=n, head_dim=d, dropout=c.dropout, causal=c.causal,
                          bias=needs_bias, kernel=c.kernel).to(mod.q_proj.weight.device, mod.q_proj.weight.dtype)
    e = mod.head_embed
    w_q = mod.q_proj.weight  # [d, m]
    b_q = mod.q_proj.bias if mod.q_proj.bias is not None else torch.zeros(d, device=w_q.device, dtype=w_q.dtype)
    w_o, b_o = mod.out_proj.weight, mod.out_proj.bias
    b_o = b_o if b_o is not None else torch.zeros(m, device=w_q.device, dtype=w_q.dtype)
    if isinstance(mod, MHEMul):
        scale = (e[0] + 1) * (e[1] + 1)  # [n, d]
        mqa.q_proj.weight.copy_((scale[:, :, None] * w_q[None]).reshape(n * d, m))
        if needs_bias:
            mqa.q_proj.bias.copy_((scale * b_q).reshape(-1))
        mqa.out_proj.weight.copy_(w_o * (e[2] + 1).reshape(1, -1))
        if needs_bias:
            mqa.out_proj.bias.copy_(b_o)
    else:
        mqa.q_proj.weight.copy_(w_q.repeat(n, 1))
        mqa.q_proj.bias.copy_((e[0] + b_q).reshape(-1))
        mqa.out_proj.weight.copy_(w_o)
        mqa.out_proj.bias.copy_(b_o + w_o @ e[2].reshape(-1))
    for name in ("k_proj", "v_proj"):
        src, dst = getattr(mod, name), getattr(mqa, name)
        dst.weight.copy_(src.weight)
        if needs_bias:
            dst.bias.copy_(src.bias if src.bias is not None else torch.zeros_like(dst.bias))
    return mqa.train(mod.training)


def fold_model(model: nn.Module) -> nn.Module:
    """Replace every fast MHE sublayer of ``model`` (in place) by its folded MQA form."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _MHEBase) and not child.reference:
                setattr(parent, name, fold_mhe(child))
    return model
