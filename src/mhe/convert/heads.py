"""One attention sublayer's weights as per-head matrices, and back.

The conversion reads only the sublayer's state dict (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj``: the names every multi-head kind keeps), so it works for any module that holds
them, whatever class computes with them. Heads are in the paper's orientation with the bias
as a last row (see :mod:`mhe.convert.fit`), in float64.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from mhe.convert.fit import expand_groups
from mhe.errors import MheError

ROLES = ("q", "k", "v")


@dataclass(frozen=True)
class Heads:
    """A multi-head sublayer: ``q``, ``k``, ``v`` ``[n, p, d]`` (p = m + 1, the bias row last;
    K and V repeated for every query head that shares them), ``out`` ``[n, m, d]`` (column block
    i of the output projection), ``out_bias`` ``[m]`` or None, and ``kv_heads``, the distinct
    K/V heads of the source (n for MHA, g for GQA, 1 for MQA)."""

    q: Tensor
    k: Tensor
    v: Tensor
    out: Tensor
    out_bias: Tensor | None
    kv_heads: int
    bias: bool

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def m(self) -> int:
        return self.q.shape[1] - 1

    @property
    def d(self) -> int:
        return self.q.shape[2]

    def role(self, r: str) -> Tensor:
        return getattr(self, r)

    def rotated(self, r_qk: Tensor, r_v: Tensor) -> "Heads":
        """The same function with head i's query and key columns turned by r_qk[unit(i)] and
        its value and output columns by r_v[unit(i)] (``[kv_heads, d, d]``, orthogonal): scores
        (X A_q R)(X A_k R)^T and outputs (A X A_v R)(O R)^T are unchanged. Query heads that share
        a K/V head (GQA, MQA) share its rotations."""
        qk, v = expand_groups(r_qk, self.n), expand_groups(r_v, self.n)  # [n, d, d]
        return replace(self, q=self.q @ qk, k=self.k @ qk, v=self.v @ v, out=self.out @ v)


def _split(weight: Tensor, bias: Tensor | None, d: int) -> Tensor:
    """``nn.Linear`` weight ``[h*d, m]`` (and bias ``[h*d]``) -> heads ``[h, m+1, d]``."""
    hd, m = weight.shape
    w = weight.detach().to(torch.float64).reshape(hd // d, d, m).transpose(1, 2)  # [h, m, d]
    b = torch.zeros(hd // d, 1, d, dtype=torch.float64, device=weight.device) if bias is None else \
        bias.detach().to(torch.float64).reshape(hd // d, 1, d)
    return torch.cat([w, b], 1)  # [h, m+1, d]


def read_heads(state: dict[str, Tensor], *, n_heads: int, head_dim: int, where: str = "") -> Heads:
    """The heads of one multi-head sublayer from its state dict (keys relative to the module)."""
    need = [f"{r}_proj.weight" for r in ROLES] + ["out_proj.weight"]
    missing = [k for k in need if k not in state]
    if missing:
        raise MheError(f"attention sublayer {where or '?'} has no {missing[0]}: only multi-head sublayers "
                       "(mha, gqa, mqa) can be converted")
    d, n = head_dim, n_heads
    bias = "q_proj.bias" in state
    q = _split(state["q_proj.weight"], state.get("q_proj.bias"), d)
    k = _split(state["k_proj.weight"], state.get("k_proj.bias"), d)
    v = _split(state["v_proj.weight"], state.get("v_proj.bias"), d)
    if q.shape[0] != n or n % k.shape[0] or k.shape != v.shape:
        raise MheError(f"attention sublayer {where or '?'}: {q.shape[0]} query and {k.shape[0]} key heads of "
                       f"width {d} do not form {n} heads in groups")
    out_w = state["out_proj.weight"].detach().to(torch.float64)
    out = out_w.reshape(out_w.shape[0], n, d).transpose(0, 1)  # [n, m, d]
    out_b = state.get("out_proj.bias")
    return Heads(q=q, k=expand_groups(k, n), v=expand_groups(v, n), out=out,
                 out_bias=None if out_b is None else out_b.detach().to(torch.float64), kv_heads=k.shape[0], bias=bias)


def linear_state(prefix: str, heads: Tensor, bias: bool) -> dict[str, Tensor]:
    """``[h, m+1, d]`` -> ``prefix.weight`` ``[h*d, m]`` (and ``prefix.bias`` ``[h*d]``)."""
    h, p, d = heads.shape
    out = {f"{prefix}.weight": heads[:, :-1].transpose(1, 2).reshape(h * d, p - 1)}
    if bias:
        out[f"{prefix}.bias"] = heads[:, -1].reshape(h * d)
    return out


def out_state(out: Tensor, out_bias: Tensor | None) -> dict[str, Tensor]:
    """Output blocks ``[n, m, d]`` -> ``out_proj.weight`` ``[m, n*d]`` (and its bias)."""
    n, m, d = out.shape
    state = {"out_proj.weight": out.transpose(0, 1).reshape(m, n * d)}
    if out_bias is not None:
        state["out_proj.bias"] = out_bias
    return state
