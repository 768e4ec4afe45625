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
share a K/V head (GQA, MQA sources) share its rotation. Under rotary positions a rotation of the
query/key dimensions does not commute with RoPE, so only values are aligned there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mhe.convert.fit import procrustes, product_error, relative_error, sqrt_psd
from mhe.convert.heads import ROLES, Heads
from mhe.convert.targets import Fitted, fit_target


@dataclass(frozen=True)
class InputStats:
    """Calibration statistics of one sublayer's input: ``mean`` ``[m]`` and ``second`` E[x x^T]
    ``[m, m]`` (float64) over ``count`` tokens."""

    mean: Tensor
    second: Tensor
    count: int

    def gram(self) -> Tensor:
        """E[x~ x~^T] of the augmented input x~ = [x, 1] ``[m+1, m+1]``: output-space norms."""
        m = self.mean.shape[0]
        g = torch.empty(m + 1, m + 1, dtype=torch.float64)
        g[:m, :m], g[:m, m], g[m, :m], g[m, m] = self.second, self.mean, self.mean, 1.0
        return g

    def centred_gram(self) -> Tensor:
        """The covariance of x~ (zero in the bias row): MHE-Add's objective once offsets are fitted."""
        m = self.mean.shape[0]
        g = torch.zeros(m + 1, m + 1, dtype=torch.float64)
        g[:m, :m] = self.second - torch.outer(self.mean, self.mean)
        return g


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


def convert_sublayer(h: Heads, kind: str, *, kv_heads: int = 1, stats: InputStats | None = None,
                     align: bool = False, align_iters: int = 20, qk_groups: list[list[int]] | None = None,
                     naive: bool = False) -> SublayerResult:
    """Convert one multi-head sublayer to ``kind`` (see :func:`mhe.convert.targets.fit_target`).

    Args:
        h: the source heads.
        kind: the target kind.
        kv_heads: K/V heads of a ``gqa`` target.
        stats: calibration statistics of the sublayer's input (MHE-Add's fit, output errors).
        align: rotate the heads towards the fit first (module docstring).
        align_iters: alternations of fit and Procrustes.
        qk_groups: query/key columns sharing one scale (rotary pairs); also turns off the
            query/key alignment, which RoPE does not allow.
        naive: write the naive initialisation (mean of the heads, zero embeddings) instead.
    """
    x_mean = stats.mean if stats is not None else None

    def fit(heads: Heads, baseline: bool = False) -> Fitted:
        return fit_target(heads, kind, kv_heads=kv_heads, naive=baseline, x_mean=x_mean, qk_groups=qk_groups)

    aligned = h
    if align and not naive and kind != "sha":  # SHA's fit does not depend on rotations
        metric = stats.centred_gram() if kind == "mhe-add" and stats is not None else None
        aligned = _align(h, fit, metric, align_iters, rotate_qk=qk_groups is None)
    fitted = fit(aligned, baseline=naive)
    base = fit(h, baseline=True)
    spaces = {"weight": (None, None)}
    if stats is not None:
        spaces["output"] = (stats.gram(), sqrt_psd(stats.gram()))
    errors = {r: {space: (_error(r, aligned, fitted, *g), _error(r, h, base, *g)) for space, g in spaces.items()}
              for r in ERROR_ROLES}
    return SublayerResult(fitted.state, errors)


def _error(role: str, h: Heads, f: Fitted, gram: Tensor | None, root: Tensor | None) -> float:
    """The relative error of ``role`` (:data:`ERROR_ROLES`) of the fit ``f`` to the heads ``h``
    (``gram``/``root``: the calibration second moment and its square root; None: weights)."""
    eff = f.effective
    if role in ROLES:
        return relative_error(h.role(role), eff[role], gram)
    if role == "qk":
        return product_error(h.q, h.k, eff["q"], eff["k"], root, root)
    parts = (h.v, h.out, eff["v"], eff["o"])
    if f.summed_outputs:  # sum_i A_i O_i^T as one product of the heads side by side: [1, *, n*d]
        parts = tuple(x.transpose(0, 1).reshape(1, x.shape[1], -1) for x in parts)
    return product_error(*parts, root, None)


def _align(h: Heads, fit, metric: Tensor | None, iters: int, *, rotate_qk: bool) -> Heads:
    """``h`` turned by the per-unit rotations that (locally) minimise the fit's objective."""
    eye = torch.eye(h.d, dtype=h.q.dtype).expand(h.kv_heads, h.d, h.d)
    r_qk, r_v = eye, eye
    for _ in range(iters):
        f = fit(h.rotated(r_qk, r_v))
        if rotate_qk:
            r_qk = _rotation(h, f, ("q", "k"), metric, r_qk)
        r_v = _rotation(h, f, ("v",), metric, r_v)
    return h.rotated(r_qk, r_v)


def _rotation(h: Heads, f: Fitted, roles: tuple[str, ...], metric: Tensor | None, current: Tensor) -> Tensor:
    """Procrustes for every K/V unit: argmax_R tr(R^T sum_i A_i^T G F_i) over its heads i and the
    fitted roles (G = I in weight space); ``current`` where no role is fitted."""
    used = [r for r in roles if r in f.fitted_roles]
    if not used:
        return current
    c = 0
    for r in used:
        a, t = h.role(r), f.effective[r]
        c = c + (torch.einsum("npd,npe->nde", a, t) if metric is None
                 else torch.einsum("npd,pq,nqe->nde", a, metric, t))  # [n, d, d]
    c = c.reshape(h.kv_heads, h.n // h.kv_heads, h.d, h.d).sum(1)  # [units, d, d]
    return procrustes(c)
