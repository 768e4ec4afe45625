"""From ``psi-then-rope`` to ``rope-then-psi``: when an MHE-Mul model whose head embeddings act
before the rotation keeps one K/V head (docs/conversion.md, "psi-then-rope, then fold?").

Under ``psi-then-rope`` head i's query and key are R_t(q * a_i) and R_s(k * b_i), a_i = 1 + eQ_i,
b_i = 1 + eK_i, so each head has its own rotated key and the cache holds n heads. A rotation
commutes with an elementwise factor only where the factor is equal within each rotary pair
(j, j + r/2), so the keys of all heads come from one cached head exactly when every b_i is one
common factor c times a factor P_i equal within each pair: then R_s(k * b_i) = P_i * R_s(k * c),
the common c goes into the key projection (W^K diag(c)) and P_i moves after the rotation, where
``rope-then-psi`` puts its head embeddings. Equivalently, the ratio b_ij / b_i(j + r/2) is the
same for every head i, for every pair. The queries are not cached, but a ``rope-then-psi``
sublayer applies one order to both, so the same must hold for a_i; the values, which RoPE leaves
alone, always fold (their factor passes the attention). A least-squares fit with free scales
(``mhe convert --set model.attn_options.rope_order=psi-then-rope``) meets this only by chance,
and uptraining under ``psi-then-rope`` moves away from it, so the fold is in general not exact:
:func:`fold_rope_order` folds with each pair's factors replaced by their mean and reports how far
that is (0: exact).

MHE-Add does not fold: its query offset before the rotation, R_t(q + eQ_i) = R_t q + R_t eQ_i,
is a position-dependent offset after it, which no ``rope-then-psi`` offset is, and its key
offsets, rotated at each key's position, no longer cancel in softmax unless all heads share them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import Tensor, nn

from mhe.attention.rotary import rotary_width
from mhe.convert.stats import attention_modules
from mhe.errors import MheError
from mhe.models import build_model, require_model


def pair_factors(f: Tensor, width: int) -> tuple[Tensor, Tensor, float]:
    """Split per-head factors ``f`` ``[n, d]`` into a common factor ``c`` ``[d]`` and per-head
    factors ``p`` ``[n, d]`` equal within each rotary pair of the first ``width`` dimensions, with
    c * p = f exactly when the within-pair ratios are the same for every head (module docstring).

    c is the mean factor over the heads (on the unrotated dimensions 1: those stay free per
    head), p the pair mean of f / c; returns (c, p, the relative gap ||f / c - p|| / ||p||)."""
    half = width // 2
    c = torch.ones(f.shape[1], dtype=f.dtype)
    c[:width] = f[:, :width].mean(0)
    if bool((c[:width].abs() < 1e-12).any()):
        raise MheError("a rotated dimension's factor averages to zero over the heads; the pairs cannot be folded")
    ratio = f / c
    p = ratio.clone()
    mean = 0.5 * (ratio[:, :half] + ratio[:, half:width])
    p[:, :half], p[:, half:width] = mean, mean
    gap = float((ratio - p).norm() / p.norm()) if float(p.norm()) > 0 else 0.0
    return c, p, gap


def fold_rope_order(model: nn.Module) -> tuple[nn.Module, list[tuple[str, float]]]:
    """An MHE-Mul ``psi-then-rope`` model as ``rope-then-psi`` (one K/V head cached): per sublayer
    the query and key factors split by :func:`pair_factors`, the common factors folded into the
    shared projections (and their biases), the pair-shared ones kept as head embeddings; values
    unchanged. Returns (the folded model, per sublayer the larger of the query and key gaps): the
    folded model computes the same function where every gap is 0."""
    require_model(model, "fold_rope_order")
    cfg = model.cfg
    opts = getattr(cfg.attn_options, "rope_order", None)
    if cfg.spec.psi != "mul" or opts != "psi-then-rope" or cfg.positions != "rotary":
        raise MheError(f"folding takes an mhe-mul model with rotary positions and rope_order=psi-then-rope, got "
                       f"{cfg.attention} ({cfg.positions} positions, rope_order={opts})")
    new_cfg = cfg.replace(attn_options=dataclasses.replace(cfg.attn_options, rope_order="rope-then-psi"))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gaps = []
    for name, mod in attention_modules(model):
        width = rotary_width(mod.cfg.head_dim, cfg.rope_fraction)
        e = state[f"{name}.head_embed"].double()  # [3, n, d]
        worst = 0.0
        for j, r in ((0, "q"), (1, "k")):
            c, p, gap = pair_factors(1 + e[j], width)
            worst = max(worst, gap)
            e[j] = p - 1
            for key in (f"{name}.{r}_proj.weight", f"{name}.{r}_proj.bias"):
                if key in state:
                    w = state[key]
                    state[key] = (w.double() * (c[:, None] if w.dim() == 2 else c)).to(w.dtype)
        state[f"{name}.head_embed"] = e.to(state[f"{name}.head_embed"].dtype)
        gaps.append((name, worst if math.isfinite(worst) else float("inf")))
    dtype = next(model.parameters()).dtype
    folded = build_model(new_cfg).to(dtype)
    folded.load_state_dict(state, strict=True)
    return folded.train(model.training), gaps
