"""One sublayer's conversion: optional head alignment, the fit, and its reconstruction errors.

Alignment (optional). Turning head i's query and key columns by one orthogonal R_i leaves its
scores unchanged, (X A_q R_i)(X A_k R_i)^T = X A_q A_k^T X^T, and turning its value and output
columns by one R'_i leaves its output unchanged. Heads trained independently need not use their
d dimensions in the same order or basis, so before merging them we choose these rotations to
bring the heads as close to the target's form as possible: block-coordinate descent on the fit's
own objective, alternating the fit (exact, given the rotations) with one orthogonal Procrustes
problem per head (exact, given the fit). Neither step can increase the objective and the first
fit is the unaligned one, so the aligned error is never larger (head alignment by Procrustes
rotation is used for merging heads in the literature, e.g. before averaging). Query heads that
share a K/V head (GQA, MQA sources) share its rotation.

Alignment under rotary positions. RoPE turns query/key dimension pairs (j, j + r/2) by position-
dependent angles, X A_q R_t, and the scores stay unchanged only if R_i commutes with every R_t:
a plane rotation on each rotary pair (2-D rotations commute) and any orthogonal map of the d - r
unrotated dimensions, (X A_q R_i R_t)(X A_k R_i R_s)^T = X A_q R_t R_s^T A_k^T X^T. The
Procrustes step is restricted to these (:func:`mhe.convert.fit.rotary_procrustes`, exact on the
restricted set), so the descent argument holds as before; values and outputs, which RoPE leaves
alone, keep the full rotation. The aligned source computes the same function, so every fit that
follows (pair-shared MHE-Mul scales, free scales under ``psi-then-rope``, rotated offsets) is a fit
to the same model. For MHE-Add's offsets after the rotation (``rope-then-psi``) the step
maximises tr(R^T (A_i^T G W - m(A_i) m(W)^T)), m the mean rotated projection
(:meth:`InputStats.rotated_mean`; m(A_i R) = m(A_i) R as R commutes with RoPE): the output error
with the best offsets for every R, the rotated counterpart of the centred second moment.

Errors under rotary positions. RoPE is orthogonal and acts alike on a source head's and a fitted
head's projections, so the query/key errors on projected outputs are those of the unrotated
projections, except for MHE-Add's offsets under ``rope-then-psi``, which act after the rotation:
their output error, E||R_t C_i^T x~_t - e_i||^2 = tr(C_i^T G C_i) - 2 e_i . E[R_t C_i^T x~_t] +
||e_i||^2 with C_i = A_i - W, is computed exactly from the rotated calibration means. The
weight-space errors and the logits' bilinear form (``qk``), which RoPE makes position-dependent,
are those at zero relative distance, with such offsets as at position 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from mhe.attention.spec import AttentionSpec, attention_spec
from mhe.convert.fit import procrustes, product_error, relative_error, rotary_procrustes, sqrt_psd
from mhe.convert.heads import ROLES, Heads
from mhe.convert.rotary import RotaryFit
from mhe.convert.stats import InputStats
from mhe.convert.targets import Fitted, fit_target


ERROR_ROLES = ("q", "k", "v", "qk", "vo")
"""The projections (query, key, value) and what a head computes with them: its logits' bilinear
form A^Q A^K^T (``qk``) and its value-to-output map A^V O^T (``vo``; for SHA, whose heads share
one pattern, the sum over heads). The products do not depend on the rotations or on how a scale
is split between query and key, so they compare every kind on the same footing."""


@dataclass(frozen=True)
class SublayerResult:
    """The converted sublayer's ``state`` and, per entry of :data:`ERROR_ROLES`, the relative
    reconstruction errors of the fit and of the naive initialisation: ``errors[role] =
    {"weight": (fitted, naive), "output": (fitted, naive)}`` (``output``, measured on the
    calibration inputs, only with calibration statistics)."""

    state: dict[str, Tensor]
    errors: dict[str, dict[str, tuple[float, float]]]


def convert_sublayer(h: Heads, kind: str | AttentionSpec, *, kv_heads: int = 1, stats: InputStats | None = None,
                     align: bool = False, align_iters: int = 20, rotary: RotaryFit | None = None,
                     naive: bool = False) -> SublayerResult:
    """Convert one multi-head sublayer to ``kind`` (see :func:`mhe.convert.targets.fit_target`).

    Args:
        h: the source heads.
        kind: the target kind's spec (a name is looked up once, here).
        kv_heads: K/V heads of a ``gqa`` target.
        stats: calibration statistics of the sublayer's input (MHE-Add's fit, output errors).
        align: rotate the heads towards the fit first (module docstring).
        align_iters: alternations of fit and Procrustes.
        rotary: how rotary positions constrain the fit (:mod:`mhe.convert.rotary`; None:
            absolute positions); it also restricts the query/key alignment to rotations that
            commute with RoPE (module docstring).
        naive: write the naive initialisation (mean of the heads, zero embeddings) instead.
    """
    spec = attention_spec(kind)

    def fit(heads: Heads, baseline: bool = False) -> Fitted:
        return fit_target(heads, spec, kv_heads=kv_heads, naive=baseline, stats=stats, rotary=rotary)

    aligned = h
    if align and not naive and not spec.single_head:  # SHA's fit does not depend on rotations
        aligned = _align(h, fit, align_iters, stats if spec.psi == "add" else None, rotary)
    fitted = fit(aligned, baseline=naive)
    base = fit(h, baseline=True)
    spaces = {"weight": (None, None, None)}
    if stats is not None:
        spaces["output"] = (stats, stats.gram(), sqrt_psd(stats.gram()))
    errors = {r: {space: (_error(r, aligned, fitted, *g), _error(r, h, base, *g)) for space, g in spaces.items()}
              for r in ERROR_ROLES}
    return SublayerResult(fitted.state, errors)


def _error(role: str, h: Heads, f: Fitted, stats: InputStats | None, gram: Tensor | None,
           root: Tensor | None) -> float:
    """The relative error of ``role`` (:data:`ERROR_ROLES`) of the fit ``f`` to the heads ``h``
    (``stats``, ``gram``, ``root``: the calibration statistics, second moment and its square
    root; None: weights)."""
    eff = f.effective
    if role in f.rotated_offsets and stats is not None:
        return _rotated_error(h.role(role), eff[role], f.rotated_offsets[role], stats, gram)
    if role in ROLES:
        return relative_error(h.role(role), eff[role], gram)
    if role == "qk":
        return product_error(h.q, h.k, eff["q"], eff["k"], root, root)
    parts = (h.v, h.out, eff["v"], eff["o"])
    if f.summed_outputs:  # sum_i A_i O_i^T as one product of the heads side by side: [1, *, n*d]
        parts = tuple(x.transpose(0, 1).reshape(1, x.shape[1], -1) for x in parts)
    return product_error(*parts, root, None)


def _rotated_error(a: Tensor, eff: Tensor, e: Tensor, stats: InputStats, gram: Tensor) -> float:
    """The output-space relative error of heads ``eff`` ``[n, p, d]`` whose offsets ``e``
    ``[n, d]`` (in their bias row) act after RoPE, to the source heads ``a`` (module docstring)."""
    shared = eff.clone()
    shared[:, -1] -= e  # [n, p, d]: the shared projection, without the offsets
    c = a - shared
    num = torch.einsum("npd,pq,nqd->", c, gram, c) - 2 * (e * stats.rotated_mean(c)).sum() + e.pow(2).sum()
    den = torch.einsum("npd,pq,nqd->", a, gram, a)
    return math.sqrt(max(float(num), 0.0) / float(den)) if float(den) > 0 else 0.0


def _align(h: Heads, fit, iters: int, stats: InputStats | None, rotary: RotaryFit | None) -> Heads:
    """``h`` turned by the per-unit rotations that (locally) minimise the fit's objective: in
    weight space, or on the calibration inputs ``stats`` (MHE-Add); query/key rotations restricted
    to those that commute with RoPE when ``rotary`` is given (module docstring)."""
    eye = torch.eye(h.d, dtype=h.q.dtype, device=h.q.device).expand(h.kv_heads, h.d, h.d)
    turn_qk = procrustes if rotary is None else partial(rotary_procrustes, width=rotary.width)
    r_qk, r_v = eye, eye
    for _ in range(iters):
        f = fit(h.rotated(r_qk, r_v))
        r_qk = _rotation(h, f, ("q", "k"), stats, r_qk, turn_qk)
        r_v = _rotation(h, f, ("v",), stats, r_v, procrustes)
    return h.rotated(r_qk, r_v)


def _rotation(h: Heads, f: Fitted, roles: tuple[str, ...], stats: InputStats | None, current: Tensor,
              solve) -> Tensor:
    """``solve`` (a Procrustes) for every K/V unit: argmax_R tr(R^T sum_i C_i) over its heads i and
    the fitted roles, C_i = A_i^T F_i in weight space (``stats`` None), else A_i^T G F_i with G the
    centred second moment, or (offsets after RoPE) A_i^T G W_i - m(A_i) m(W_i)^T (module
    docstring); ``current`` where no role is fitted."""
    used = [r for r in roles if r in f.fitted_roles]
    if not used:
        return current
    c = 0
    for r in used:
        a, t = h.role(r), f.effective[r]
        if stats is None:
            c = c + torch.einsum("npd,npe->nde", a, t)  # [n, d, d]
        elif r in f.rotated_offsets:
            shared = t.clone()
            shared[:, -1] -= f.rotated_offsets[r]  # W_i: the shared projection, without the offsets
            c = c + torch.einsum("npd,pq,nqe->nde", a, stats.gram(), shared) \
                - torch.einsum("nd,ne->nde", stats.rotated_mean(a), stats.rotated_mean(shared))
        else:
            c = c + torch.einsum("npd,pq,nqe->nde", a, stats.centred_gram(), t)
    c = c.reshape(h.kv_heads, h.n // h.kv_heads, h.d, h.d).sum(1)  # [units, d, d]
    return solve(c)
