"""What rotary positions (RoPE) change in a conversion (docs/paper-notes.md, "MHE with rotary
positions").

RoPE turns each pair of query/key dimensions (j, j + r/2), j < r/2, of the first r = the rotated
width (``rotate_half`` layout, :mod:`mhe.attention.rotary`) by an angle proportional to the
position; the other d - r dimensions pass through. Three consequences for the fits:

* Query/key alignment by rotations that commute with RoPE: a general orthogonal turn of a
  head's dimensions does not, but a plane rotation within each rotary pair does (2-D rotations
  commute), and so does any orthogonal map of the unrotated dimensions; queries and keys are
  aligned within these, values and outputs by any rotation (:mod:`mhe.convert.sublayer`,
  :func:`mhe.convert.fit.rotary_procrustes`).
* Where an elementwise factor acts after the rotation (MHE's ``rope_order="rope-then-psi"``, the
  default; SHA's folded query scale), (R_t q) * s = R_t (q * s) holds only when s is equal
  within each rotary pair, so the fitted query/key scales are shared within the pairs
  (:attr:`RotaryFit.pairs`), and a source whose heads are W diag(s_i) with such scales is
  recovered exactly. Under ``psi-then-rope`` the head embeddings act before the rotation,
  R_t (W x * s_i) = R_t (W diag(s_i) x): the unconstrained per-dimension fit is then the exact
  one (each head's scales free), at the cost of a KV cache of n rotated heads.
* MHE-Add under ``rope-then-psi``: head i's query is R_t (W x_t + b) + e_i, an offset added
  after the rotation. Fitted to a source head R_t (A_i^T x~_t) (x~ = [x, 1]) over calibration
  tokens, sum_t ||R_t (A_i - W)^T x~_t - e_i||^2 is minimised by e_i = mean_t R_t (A_i - W)^T x~_t,
  the mean of the *rotated* residual projections, and (the cross terms summing to zero over the
  heads, as without rotation) by W = the mean of the heads. That mean is computed exactly from
  two calibration moments per rotary frequency k, E[cos(t theta_k) x~_t] and E[sin(t theta_k)
  x~_t] (:meth:`mhe.convert.sublayer.InputStats.rotated_mean`). The key offsets cancel in
  softmax under this order (they are fitted the same way, which changes nothing computed).
  Under ``psi-then-rope`` the offsets act before the rotation, as a bias would, and the fit
  without rotation is the exact one.
"""

from __future__ import annotations

from dataclasses import dataclass

from mhe.attention.rotary import rotary_width
from mhe.attention.spec import AttentionSpec, attention_spec



@dataclass(frozen=True)
class RotaryFit:
    """How RoPE constrains one sublayer's fit: ``head_dim`` d, ``width`` r (the rotated
    dimensions, the first r of each head) and the target's ``order`` (MHE's ``rope_order``;
    ``""`` for kinds without head embeddings)."""

    head_dim: int
    width: int
    order: str = ""

    @property
    def pairs(self) -> list[list[int]]:
        """The rotary pairs [j, j + r/2] and every unrotated dimension on its own."""
        half = self.width // 2
        return [[j, j + half] for j in range(half)] + [[j] for j in range(self.width, self.head_dim)]

    @property
    def psi_after(self) -> bool:
        """The head embeddings act on the rotated queries and keys (``rope-then-psi``)."""
        return self.order != "psi-then-rope"

    def scale_groups(self) -> list[list[int]] | None:
        """Query/key columns that must share one scale: the pairs where a scale acts after the
        rotation; None (every column free) under ``psi-then-rope``."""
        return self.pairs if self.psi_after else None

    def describe(self, kind: str | AttentionSpec) -> str:
        """One line for the command's output and ``conversion.json``: what the order means here."""
        rotated = f"rotary positions on {self.width} of {self.head_dim} dimensions per head"
        spec = attention_spec(kind)
        if spec.single_head:
            return f"{rotated}: one query scale per rotary pair"
        if not spec.is_mhe:
            return f"{rotated}: queries and keys are aligned only by rotations that commute with RoPE"
        if not self.psi_after:
            return (f"{rotated}, rope_order=psi-then-rope: the head embeddings act before the rotation, so each "
                    "dimension's scale or offset is fitted freely and the KV cache holds n rotated heads")
        what = ("query/key scales are shared within each rotary pair" if spec.psi == "mul" else
                "query offsets are the mean of the rotated residual projections over the calibration tokens")
        return (f"{rotated}, rope_order=rope-then-psi: the head embeddings act after the rotation, so the {what}; "
                "one K/V head is cached")


def rotary_fit(cfg, head_dim: int, kind: str | AttentionSpec, options) -> RotaryFit | None:
    """The :class:`RotaryFit` of a sublayer of a model configured by ``cfg`` converted to
    ``kind`` with ``options`` (its ``model.attn_options``); None for absolute positions."""
    if getattr(cfg, "positions", "") != "rotary":
        return None
    order = getattr(options, "rope_order", "") if attention_spec(kind).is_mhe else ""
    return RotaryFit(head_dim, rotary_width(head_dim, cfg.rope_fraction), order)
