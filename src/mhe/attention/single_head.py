"""SHA: the single-head baseline, counted as the paper counts it."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from mhe.attention.base import Attention, AttentionConfig


class SingleHeadAttention(Attention):
    """Single-head attention with one head of width d (paper section 4.1).

    The paper's SHA rows keep an (n*d) x m output projection: BERT-base SHA is
    12 * (3*768*64 + 768*768) = 8,847,360 parameters (Tables 1-2). We read this
    as one head whose output is tiled n times before that projection, which is
    exactly MHE with all head embeddings at zero (section 3.3: "a seed
    projection matrix ... is equivalent to a single-head attention"). Tiling
    and projecting equals projecting with the sum of the n column blocks of
    W^O, which is what we compute.

    Parameters: 3*m*d (Q, K, V) + n*d*m (output).
    """

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        super().__init__(cfg, kind=kind)
        m, d = cfg.d_model, cfg.head_dim
        self.q_proj = nn.Linear(m, d, bias=cfg.in_bias)
        self.k_proj = nn.Linear(m, d, bias=cfg.in_bias)
        self.v_proj = nn.Linear(m, d, bias=cfg.in_bias)
        self.out_proj = nn.Linear(cfg.inner_dim, m, bias=cfg.bias)

    def _queries(self, x, positions):
        return self._rotate(self.q_proj(x).unsqueeze(1), positions)  # [B, 1, T, d]

    def _keys_values(self, src, positions):
        return self._rotate(self.k_proj(src).unsqueeze(1), positions), self.v_proj(src).unsqueeze(1)  # [B, 1, S, d]

    def _output(self, h):
        c = self.cfg
        w = self.out_proj.weight.view(c.d_model, c.n_heads, c.head_dim).sum(1)  # [m, d]
        return F.linear(h.squeeze(1), w, self.out_proj.bias)  # [B, T, m]
