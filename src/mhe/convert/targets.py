"""What each target kind's weights are, fitted to a multi-head sublayer's heads.

Every function takes :class:`~mhe.convert.heads.Heads` and returns a :class:`Fitted`: the new
sublayer's state dict and, per role, the projection each head effectively computes with
(``[n, p, d]``; ``o``: its output block ``[n, m, d]``), against which the reconstruction error is
measured. ``naive=True`` gives the baseline every fit is compared with: the mean of the heads,
head embeddings zero, output projection kept.

* ``mqa`` / ``gqa``: K and V heads mean-pooled within each group (Ainslie et al. 2023,
  section 2.2); queries and output projection kept.
* ``mhe-mul``: W^{Q,K,V} and e^{Q,K,V} from :func:`~mhe.convert.fit.rank1_scales`, the exact
  least-squares solution of A_i ~ W diag(1 + e_i); the value scales stay in ``head_embed[2]``,
  which MHE-Mul applies to the output projection's column blocks (docs/paper-notes), so the
  output projection is kept as it is.
* ``mhe-add``: psi(A, e) = A + e. In weight space the fit is degenerate (every A_i - W is
  matched by nothing but an offset), so it is fitted on projected outputs over calibration
  inputs X (rows x_t, mean x_bar): minimise sum_i ||X W_i + 1 b_i^T - (X W + 1 (b + e_i)^T)||^2.
  For fixed W the best offset is the column mean of the residual, b + e_i = b_i + x_bar (W_i - W);
  what is left is (X - 1 x_bar)(W_i - W), minimised by W = mean_i W_i. So W and b are the
  means of the heads and e_i = x_bar (W_i - W) + (b_i - b) = [x_bar, 1] (A_i - mean A); without
  calibration (x_bar = 0) the offsets take only the bias differences. Under rotary positions
  with ``rope_order="rope-then-psi"`` the query/key offsets act after the rotation, and the best
  ones are the means of the rotated residuals, e_i = mean_t R_t (A_i - W)^T x~_t, exactly
  computable from calibration moments (:mod:`mhe.convert.rotary`); W is still the mean.
* ``sha``: one head of width d whose output projection is tiled n times, i.e. projects with the
  sum of its column blocks (``attention/single_head.py``). One attention pattern serves every
  head, so what can be matched is the mean of the heads' logit forms, (1/n) sum_i A^Q_i A^K_i^T,
  and the sum of their value-to-output maps, sum_i A^V_i O_i^T (exactly the multi-head output
  when all heads attend alike). SHA's are W^Q W^K^T and W^V (sum of blocks)^T, products of rank
  d, so each is the best rank-d approximation (Eckart-Young, :func:`~mhe.convert.fit.
  low_rank_factors`) of its target, every output block 1/n of the fitted sum. Both are unchanged
  by head rotations (alignment does nothing here). Under rotary positions the logits are no
  bilinear form of the inputs, so the queries and keys take the MHE-Mul fit folded to one
  pattern instead: W^Q diag(mean_i (1+eQ_i)(1+eK_i)) and W^K, with scales shared within rotary
  pairs.

Under rotary positions, ``mhe-mul``'s query/key scales are shared within each rotary pair when
the head embeddings act after the rotation (``rope-then-psi``) and free under ``psi-then-rope``
(:class:`~mhe.convert.rotary.RotaryFit`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from mhe.attention.spec import AttentionSpec, attention_spec
from mhe.convert.fit import expand_groups, group_means, low_rank_factors, rank1_scales
from mhe.convert.heads import ROLES, Heads, linear_state, out_state
from mhe.convert.options import MINIMISES, TARGETS  # noqa: F401 (re-exported)
from mhe.convert.rotary import RotaryFit
from mhe.convert.stats import InputStats

@dataclass(frozen=True)
class Fitted:
    """A converted sublayer: ``state`` (keys relative to the module, float64), ``effective``
    (role -> ``[n, p, d]``, the projection head i computes with) and ``fitted_roles`` (the roles
    whose heads were merged; the others are the source's own)."""

    state: dict[str, Tensor]
    effective: dict[str, Tensor]
    fitted_roles: tuple[str, ...]
    summed_outputs: bool = False  # SHA: its heads share one pattern, so only their summed output counts
    rotated_offsets: dict[str, Tensor] = field(default_factory=dict)
    """MHE-Add under ``rope-then-psi``: role -> the offsets ``[n, d]`` that act after the rotation
    (``effective`` carries them in its bias row, i.e. as at position 0, where R_0 = I)."""


def fit_target(h: Heads, kind: str | AttentionSpec, *, kv_heads: int = 1, naive: bool = False,
               stats: InputStats | None = None, rotary: RotaryFit | None = None) -> Fitted:
    """The ``kind`` sublayer fitted to ``h``.

    Args:
        h: the source heads (already aligned, if alignment is used).
        kind: the spec of one of :data:`TARGETS` (or its name).
        kv_heads: K/V heads of a ``gqa`` target (``mqa``: 1).
        naive: the mean of the heads and zero head embeddings instead of the fit.
        stats: calibration statistics of the sublayer's input (``mhe-add``'s offsets); None: a
            zero mean input.
        rotary: how rotary positions constrain the fit (None: absolute positions).
    """
    spec = attention_spec(kind)
    if spec.head_groups:  # mqa's one K/V head, gqa's kv_heads
        return _pooled(h, kv_heads if spec.grouped else spec.kv_heads(h.n, spec.options()))
    if spec.psi == "add":
        return _add(h, naive, stats, rotary is not None and rotary.psi_after)
    if spec.single_head:
        return _sha(h, naive, rotary.pairs if rotary else None)
    return _mul(h, *_mul_fit(h, naive, rotary.scale_groups() if rotary else None))


def _pooled(h: Heads, groups: int) -> Fitted:
    state = {**linear_state("q_proj", h.q, h.bias), **out_state(h.out, h.out_bias)}
    eff = {"q": h.q, "o": h.out}
    for r in ("k", "v"):
        pooled = group_means(h.role(r), groups)  # [g, p, d]: the mean over each group's query heads
        state.update(linear_state(f"{r}_proj", pooled, h.bias))
        eff[r] = expand_groups(pooled, h.n)
    return Fitted(state, eff, ("k", "v"))


def _mul_fit(h: Heads, naive: bool, qk_groups) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    w, s = {}, {}
    for r in ROLES:
        a = h.role(r)
        if naive:
            w[r], s[r] = a.mean(0), torch.ones(h.n, h.d, dtype=a.dtype, device=a.device)
        else:
            w[r], s[r] = rank1_scales(a, qk_groups if r in ("q", "k") else None)
    return w, s


def _shared_state(w: dict[str, Tensor], bias: bool) -> dict[str, Tensor]:
    state = {}
    for r in ROLES:
        state.update(linear_state(f"{r}_proj", w[r][None], bias))  # one head: [1, p, d]
    return state


def _mul(h: Heads, w, s) -> Fitted:
    state = {**_shared_state(w, h.bias), **out_state(h.out, h.out_bias),
             "head_embed": torch.stack([s[r] - 1 for r in ROLES])}  # [3, n, d]
    eff = {r: w[r][None] * s[r][:, None, :] for r in ROLES}  # W diag(s_i): [n, p, d]
    return Fitted(state, {**eff, "o": h.out}, ROLES)


def _sha(h: Heads, naive: bool, qk_groups) -> Fitted:
    if naive:
        one, out = {r: h.role(r).mean(0) for r in ROLES}, h.out
    else:
        if qk_groups is None:  # the best rank-d form of the heads' mean logits
            wq, wk = low_rank_factors(torch.einsum("npd,nqd->pq", h.q, h.k) / h.n, h.d)
        else:  # rotary: the MHE-Mul fit folded to one pattern
            w, s = _mul_fit(h, False, qk_groups)
            wq, wk = w["q"] * (s["q"] * s["k"]).mean(0), w["k"]
        wv, o_sum = low_rank_factors(torch.einsum("npd,nmd->pm", h.v, h.out), h.d)  # [p, d], [m, d]
        one, out = {"q": wq, "k": wk, "v": wv}, (o_sum / h.n)[None].expand(h.n, -1, -1)
    state = {**_shared_state(one, h.bias), **out_state(out, h.out_bias)}
    eff = {**{r: one[r][None].expand(h.n, -1, -1) for r in ROLES}, "o": out}
    return Fitted(state, eff, ROLES, summed_outputs=True)


def _add(h: Heads, naive: bool, stats: InputStats | None, rotated: bool) -> Fitted:
    """MHE-Add (module docstring); ``rotated``: the query/key offsets act after RoPE."""
    xt = torch.zeros(h.m + 1, dtype=h.q.dtype, device=h.q.device)
    xt[-1] = 1.0
    if stats is not None:
        xt = stats.augmented_mean()
    w, e, eff, after = {}, [], {}, {}
    for r in ROLES:
        a = h.role(r)
        w[r] = a.mean(0)  # [p, d]: W and b, the means of the heads
        if naive:
            e_r = torch.zeros(h.n, h.d, dtype=a.dtype, device=a.device)
        elif rotated and r != "v" and stats is not None:
            e_r = after[r] = stats.rotated_mean(a - w[r])  # the mean rotated residual
        else:
            e_r = torch.einsum("p,npd->nd", xt, a - w[r])
        e.append(e_r)
        eff_r = w[r][None].repeat(h.n, 1, 1)
        eff_r[:, -1] += e_r  # the offset as a per-head bias (after RoPE: as at position 0)
        eff[r] = eff_r
    state = {**_shared_state(w, h.bias), **out_state(h.out, h.out_bias), "head_embed": torch.stack(e)}
    return Fitted(state, {**eff, "o": h.out}, ROLES, rotated_offsets=after)
