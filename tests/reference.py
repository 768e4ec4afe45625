"""Slow, literal implementations of the paper's equations, for comparison in tests.

Everything loops over heads and writes the softmax out by hand (Eq. 3) with a
hand-built causal mask; weights are read from the module under test.
"""

from __future__ import annotations

import math

import torch


def softmax_attention(q, k, v, *, causal=False, key_mask=None, offset=0):
    """One head: q [B, T, d], k, v [B, S, d] -> [B, T, d]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t, s = q.shape[1], k.shape[1]
    allowed = torch.ones(q.shape[0], t, s, dtype=torch.bool)
    if causal:
        for i in range(t):
            for j in range(s):
                if j > i + offset:
                    allowed[:, i, j] = False
    if key_mask is not None:
        allowed &= key_mask[:, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _lin(x, layer, rows=None):
    w = layer.weight if rows is None else layer.weight[rows]
    b = layer.bias if (layer.bias is None or rows is None) else layer.bias[rows]
    return x @ w.T + (0 if b is None else b)


def reference_forward(mod, x, *, context=None, mask=None):
    """The kind's equations head by head; returns [B, T, m]."""
    kind = mod.kind
    cfg = mod.cfg
    n, d, m = cfg.n_heads, cfg.head_dim, cfg.d_model
    src = x if context is None else context
    causal = cfg.causal and context is None
    heads = []
    if kind in ("mha", "gqa", "mqa", "skv", "el-att"):
        g = {"mha": n, "gqa": mod.n_kv_heads, "mqa": 1, "skv": n, "el-att": n}[kind]
        for i in range(n):
            qi = _lin(x, mod.q_proj, slice(i * d, (i + 1) * d))
            j = i // (n // g)
            if kind == "skv":
                ki = vi = _lin(src, mod.kv_proj, slice(j * d, (j + 1) * d))
            elif kind == "el-att":
                ki = vi = src[..., j * d:(j + 1) * d]
            else:
                ki = _lin(src, mod.k_proj, slice(j * d, (j + 1) * d))
                vi = _lin(src, mod.v_proj, slice(j * d, (j + 1) * d))
            heads.append(softmax_attention(qi, ki, vi, causal=causal, key_mask=mask))
        return _lin(torch.cat(heads, -1), mod.out_proj)
    if kind == "sha":
        h = softmax_attention(_lin(x, mod.q_proj), _lin(src, mod.k_proj), _lin(src, mod.v_proj),
                              causal=causal, key_mask=mask)
        return _lin(torch.cat([h] * n, -1), mod.out_proj)  # one head tiled n times
    if kind in ("mhe-add", "mhe-mul"):
        e = mod.head_embed
        q, k, v = _lin(x, mod.q_proj), _lin(src, mod.k_proj), _lin(src, mod.v_proj)  # Eq. 4
        psi = (lambda a, b: a * (b + 1)) if kind == "mhe-mul" else (lambda a, b: a + b)  # section 3.4
        for i in range(n):  # Eqs. 5-6
            heads.append(softmax_attention(psi(q, e[0, i]), psi(k, e[1, i]), psi(v, e[2, i]),
                                           causal=causal, key_mask=mask))
        return _lin(torch.cat(heads, -1), mod.out_proj)
    if kind == "fnet":
        xm = x if mask is None else x * mask[..., None]
        out = torch.zeros_like(xm)
        t = xm.shape[1]
        for b in range(xm.shape[0]):  # DFT written out along both axes
            it, im = torch.arange(t, dtype=torch.float64), torch.arange(m, dtype=torch.float64)
            fs = torch.exp(-2j * math.pi * torch.outer(it, it) / t)
            fm = torch.exp(-2j * math.pi * torch.outer(im, im) / m)
            out[b] = (fs @ xm[b].to(torch.complex128) @ fm).real.to(x.dtype)
        return out
    if kind == "linear":
        xm = x if mask is None else x * mask[..., None]
        t = x.shape[1]
        w = mod.seq_mix[:t, :t]
        if cfg.causal:
            w = torch.tril(w)
        return _lin(w @ xm, mod.hidden_mix)
    raise KeyError(kind)
