"""Calibration statistics: what a conversion needs to know of each attention sublayer's inputs.

:func:`input_stats` runs the source model over calibration batches and keeps, per sublayer, the
first and second moments of its input (projected-output norms, MHE-Add's offsets) and, under
rotary positions, the position-weighted moments that give the mean of the rotated projections
exactly (:meth:`InputStats.rotated_mean`; :mod:`mhe.convert.rotary` says why they are needed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mhe.attention.base import Attention


def attention_modules(model: nn.Module) -> list[tuple[str, Attention]]:
    """(state-dict prefix, module) of every attention sublayer, in order."""
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, Attention)]


@dataclass(frozen=True)
class InputStats:
    """Calibration statistics of one sublayer's input: ``mean`` ``[m]`` and ``second`` E[x x^T]
    ``[m, m]`` (float64) over ``count`` tokens; under rotary positions ``cos_mean`` and
    ``sin_mean`` ``[r/2, m+1]``, E[cos(t theta_k) x~_t] and E[sin(t theta_k) x~_t] over the tokens'
    positions t for each rotary frequency k (x~ = [x, 1]; None without rotary positions)."""

    mean: Tensor
    second: Tensor
    count: int
    cos_mean: Tensor | None = None
    sin_mean: Tensor | None = None

    def to(self, device: torch.device | str) -> "InputStats":
        """The same statistics on ``device`` (where a conversion's fits run)."""
        moved = {k: None if v is None else v.to(device) for k, v in
                 (("mean", self.mean), ("second", self.second), ("cos_mean", self.cos_mean),
                  ("sin_mean", self.sin_mean))}
        return InputStats(count=self.count, **moved)

    def augmented_mean(self) -> Tensor:
        """E[x~] of x~ = [x, 1] ``[m+1]``."""
        return torch.cat([self.mean, torch.ones(1, dtype=self.mean.dtype, device=self.mean.device)])

    def rotated_mean(self, c: Tensor) -> Tensor:
        """E_t[R_t c_i^T x~_t] ``[n, d]`` for heads ``c`` ``[n, p, d]``: the mean over the
        calibration tokens of their projections rotated by RoPE at each token's position.

        ``cos_mean``/``sin_mean`` ``[r/2, p]`` hold E[cos(t theta_k) x~_t] and E[sin(t theta_k) x~_t]
        for every rotary frequency k; with y = c^T x~, RoPE gives y_k cos - y_{k+r/2} sin at k and
        y_{k+r/2} cos + y_k sin at k + r/2 (``rotate_half``), and dimensions from r on unrotated,
        so each mean is one such moment times a column of c (:mod:`mhe.convert.rotary`)."""
        mu = torch.einsum("p,npd->nd", self.augmented_mean(), c)  # [n, d]: the unrotated dimensions
        if self.cos_mean is None:
            return mu
        h = self.cos_mean.shape[0]
        first, second = c[..., :h], c[..., h:2 * h]  # [n, p, r/2] each
        mu[:, :h] = _moment(self.cos_mean, first) - _moment(self.sin_mean, second)
        mu[:, h:2 * h] = _moment(self.cos_mean, second) + _moment(self.sin_mean, first)
        return mu

    def gram(self) -> Tensor:
        """E[x~ x~^T] of the augmented input x~ = [x, 1] ``[m+1, m+1]``: output-space norms."""
        m = self.mean.shape[0]
        g = torch.empty(m + 1, m + 1, dtype=torch.float64, device=self.mean.device)
        g[:m, :m], g[:m, m], g[m, :m], g[m, m] = self.second, self.mean, self.mean, 1.0
        return g

    def centred_gram(self) -> Tensor:
        """The covariance of x~ (zero in the bias row): MHE-Add's objective once offsets are fitted."""
        m = self.mean.shape[0]
        g = torch.zeros(m + 1, m + 1, dtype=torch.float64, device=self.mean.device)
        g[:m, :m] = self.second - torch.outer(self.mean, self.mean)
        return g


def _moment(stat: Tensor, cols: Tensor) -> Tensor:
    """``stat`` ``[k, p]`` times column k of each head ``cols`` ``[n, p, k]`` -> ``[n, k]``."""
    return torch.einsum("kp,npk->nk", stat, cols)


@torch.no_grad()
def input_stats(model: nn.Module, batches) -> dict[str, InputStats]:
    """Mean and second moment of every attention sublayer's input over ``batches`` (token id
    tensors ``[B, T]``, or dicts of model inputs), accumulated in float64; under rotary positions
    also the moments E[cos(t theta_k) x~_t], E[sin(t theta_k) x~_t] of every rotary frequency at
    each token's position t (:meth:`InputStats.rotated_mean`), from the sublayer's own table."""
    sums: dict[str, dict] = {}

    def hook(name):
        def record(mod, args, kwargs):
            x = args[0].detach().to(torch.float64)  # [B, T, m]
            s = sums.setdefault(name, {"count": 0})
            _add(s, "sum", x.flatten(0, -2).sum(0))
            _add(s, "second", x.flatten(0, -2).T @ x.flatten(0, -2))
            s["count"] += x.shape[0] * x.shape[1]
            if mod.rotary is not None:
                pos = kwargs.get("positions")
                pos = torch.arange(x.shape[1], device=x.device) if pos is None else pos
                cos, sin = mod.rotary.table(x.device)  # [L, r]: frequency k at k and k + r/2
                half = mod.rotary.width // 2
                xt = torch.cat([x, torch.ones_like(x[..., :1])], -1)  # [B, T, m+1]
                for key, table in (("cos", cos), ("sin", sin)):
                    w = table[:, :half][pos].to(torch.float64).expand(x.shape[0], x.shape[1], half)  # [B, T, r/2]
                    _add(s, key, torch.einsum("btk,btp->kp", w, xt))
        return record

    handles = [mod.register_forward_pre_hook(hook(name), with_kwargs=True) for name, mod in attention_modules(model)]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {name: InputStats(mean=(s["sum"] / s["count"]).cpu(), second=(s["second"] / s["count"]).cpu(),
                             count=s["count"], cos_mean=_mean(s, "cos"), sin_mean=_mean(s, "sin"))
            for name, s in sums.items()}


def _add(sums: dict, key: str, value: torch.Tensor) -> None:
    sums[key] = sums[key] + value if key in sums else value


def _mean(sums: dict, key: str) -> torch.Tensor | None:
    return (sums[key] / sums["count"]).cpu() if key in sums else None
