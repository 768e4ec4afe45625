"""Multi-head embedding attention, MHE-Add and MHE-Mul (paper section 3).

One shared "seed" projection per query, key and value (Eq. 4: Q, K, V = X W^{Q,K,V},
W in R^{m x d}) and one head embedding per head and role, e_i^{Q,K,V} in R^d,
stored as ``head_embed[3, n, d]`` in the order q, k, v. Head i attends with
(Eq. 5-6) Q~_i, K~_i, V~_i = psi(Q; K; V, e_i) where

* MHE-Add (section 3.4): psi(A, e) = A + e;
* MHE-Mul (section 3.4): psi(A, e) = A * (e + 1) (Hadamard product).

Parameters: 3*m*d (seed projections) + n*d*m (output) + 3*n*d (head
embeddings). Table 4 (no output projection, m = n*d): 3 d^2 n + 3 d n.

Two implementations compute the same function:

``reference``
    The equations literally: n explicit copies of Q~, K~ and V~.
``fast`` (default)
    Never materialises n copies of K or V (identities in docs/paper-notes):

    * Mul: (Q*(1+eQ_i))(K*(1+eK_i))^T = (Q*(1+eQ_i)*(1+eK_i)) K^T, so every head
      attends over the one shared K with a per-head query scale; and
      A_i (V*(1+eV_i)) = (A_i V)*(1+eV_i), so the value scale is folded into the
      columns of the output projection. The sublayer is a multi-query attention
      with tied, rescaled query weights: its KV cache holds one head.
    * Add: (Q+eQ_i)(K+eK_i)^T differs from (Q+eQ_i)K^T by a term constant along
      the keys, which softmax cancels, so eK has no effect (and zero gradient);
      A_i (V + 1 eV_i^T) = A_i V + eV_i^T because attention rows sum to one, so
      the value offsets become an output bias W^O eV. Under attention dropout
      rows no longer sum to one; then (training with dropout > 0 only) the
      values are expanded per head so both paths still agree.

    The per-head query scales/offsets are applied by building an (n*d) x m
    query weight from the shared d x m one (``query_fold="weight"``: one GEMM,
    as MQA's query projection) or by one broadcast on the d-wide projection
    (``query_fold="activation"``: fewer FLOPs, one extra elementwise pass).

Rotary positions (beyond the paper; docs/paper-notes.md, "MHE with rotary positions"). A
rotation commutes with an elementwise factor only where the factor is equal within each rotary
pair, so the order of psi and RoPE matters:

``rope_order="rope-then-psi"`` (default)
    The head embeddings act on the rotated query and key: (R_t q)*(1+eQ_i) . (R_s k)*(1+eK_i)
    = ((R_t q)*(1+eQ_i)*(1+eK_i)) . R_s k, and MHE-Add's key offsets still cancel, so the fast
    path keeps one shared, rotated K/V head. It rotates the shared d-wide query and applies the
    per-head factors after the rotation (the activation fold, whatever ``query_fold`` says: the
    weight fold would scale before the rotation); such a sublayer has no plain-MQA form, so it is
    never folded (``folded_query`` refuses), and generation runs it as it is.
``rope_order="psi-then-rope"``
    The equations with the rotation applied to psi's result: R_t(q*(1+eQ_i)) . R_s(k*(1+eK_i)).
    No key can be shared, so both implementations compute n explicit heads and the KV cache holds
    n rotated heads (``cache_heads``).

Initialisation (the paper leaves it open): head embeddings ~ N(0, init_std)
with init_std = 0.02, the scale BERT uses for its learned position embeddings,
which inspired MHE. For MHE-Mul this starts every head close to SHA (the
"+1" of section 3.4); the heads separate because the output projection's
column blocks differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mhe.attention.base import Attention, AttentionConfig
from mhe.attention.fused_projections import fused_factors, fused_output, fused_projection
from mhe.attention.kernels import FactoredQuery
from mhe.attention.options import IMPLS, QUERY_FOLDS, ROPE_ORDERS, MHEOptions  # noqa: F401 (re-exported)
from mhe.errors import MheError

class _MHEBase(Attention):
    multiplicative: bool = False

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        super().__init__(cfg, kind=kind)
        m, n, d = cfg.d_model, cfg.n_heads, cfg.head_dim
        self.q_proj = nn.Linear(m, d, bias=cfg.in_bias)
        self.k_proj = nn.Linear(m, d, bias=cfg.in_bias)
        self.v_proj = nn.Linear(m, d, bias=cfg.in_bias)
        self.out_proj = nn.Linear(n * d, m, bias=cfg.bias)
        self.head_embed = nn.Parameter(torch.empty(3, n, d))  # [q|k|v, n, d]
        self.reset_head_embeddings()

    def reset_head_embeddings(self) -> None:
        nn.init.normal_(self.head_embed, mean=0.0, std=self.cfg.options.init_std)

    @property
    def reference(self) -> bool:
        return self.cfg.options.impl == "reference"

    @property
    def literal(self) -> bool:
        """Computes n explicit heads: the reference, or psi-then-rope under rotary positions."""
        return self.spec.literal(self.cfg.options, rotary=self.rotary is not None)

    @property
    def foldable(self) -> bool:
        """Equals the plain multi-query sublayer :func:`~mhe.attention.folding.fold_mhe` builds:
        the fast path without rotary positions."""
        return not self.literal and self.rotary is None

    def _psi(self, a: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """psi(A, e_i) for every head: A [B, 1|n, S, d], e [n, d] -> [B, n, S, d]."""
        e = e[None, :, None, :]
        return a * (e + 1) if self.multiplicative else a + e

    def _embed(self, a: torch.Tensor, e: torch.Tensor, positions) -> torch.Tensor:
        """psi and the rotation in ``rope_order``: ``a [B, 1, S, d] -> [B, n, S, d]``."""
        if self.cfg.options.rope_order == "psi-then-rope":
            return self._rotate(self._psi(a, e), positions)
        return self._psi(self._rotate(a, positions), e)

    # --- literal: Eqs. 4-6 (with the rotation where rope_order puts it) -------------
    def _queries(self, x, positions):
        if self.literal:
            return self._embed(self.q_proj(x).unsqueeze(1), self.head_embed[0], positions)  # [B, n, T, d]
        return self._fast_queries(x, positions)

    def _keys_values(self, src, positions):
        k, v = self.k_proj(src).unsqueeze(1), self.v_proj(src).unsqueeze(1)  # [B, 1, S, d]
        if self.literal:
            return self._embed(k, self.head_embed[1], positions), self._psi(v, self.head_embed[2])  # [B, n, S, d]
        return self._rotate(k, positions), v  # one shared head: psi moves onto the query and the output

    def _output(self, h):
        if self.literal:
            return self.out_proj(self._merge_heads(h))
        return self._fast_output(h)

    def projections_to_fuse(self):
        return None if self.literal else (self.q_proj, self.k_proj, self.v_proj)

    def query_factors_to_keep(self) -> torch.Tensor | None:
        """The per-head query factors an inference view keeps made once (the fast path under
        rotary positions, which applies them to the rotated shared query every step)."""
        return self._query_factors() if not self.literal and self.rotary is not None else None

    def output_to_keep(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The folded output weight and bias an inference view keeps made once (the fast path
        under rotary positions, which folds them at every step: :meth:`folded_output`)."""
        return self.folded_output() if not self.literal and self.rotary is not None else None

    def _step_product(self, x):
        """In a fused view decoding (the fast path under rotary positions, no autograd) the shared
        query and key are rotated last and the heads' factors come after, in the attention kernel
        (:meth:`_step_query`); the literal form and the model itself make their heads first."""
        fused = fused_projection(self)
        if fused is None or self.literal or torch.is_grad_enabled():
            return None
        return fused(x), 1, 1  # [B, 1, 3d]: the shared query, key and value

    def _step_query(self, q):
        kept = fused_factors(self)
        factors = self._query_factors() if kept is None else kept
        return FactoredQuery(q, factors, add=not self.multiplicative)

    def _self_projections(self, x, positions):
        fused = fused_projection(self)
        if fused is None or self.literal:
            return super()._self_projections(x, positions)
        q, k, v = (t.unsqueeze(1) for t in fused(x).chunk(3, -1))  # 3 x [B, 1, T, d]: the shared heads
        kept = fused_factors(self)
        factors = self._query_factors() if kept is None else kept
        q, k = self._rotate(q, positions), self._rotate(k, positions)
        if not torch.is_grad_enabled():  # a view decoding: the kernel may make the heads as it loads them
            return FactoredQuery(q, factors, add=not self.multiplicative), k, v
        return self._psi_factor(q, factors), k, v  # [B, n, T, d]

    # --- fast path: the folded weights (docs/paper-notes.md, "MHE computed without n copies") ---
    def _query_factors(self) -> torch.Tensor:
        """Per-head factor (Mul, [n, d]) or offset (Add, [n, d]) applied to the shared query."""
        raise NotImplementedError

    def folded_query(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The query weight ``[n*d, m]`` and bias ``[n*d]`` (None when there is none) of the
        multi-query sublayer this module equals, built from the shared ``[d, m]`` one.

        MHE-Mul: (Q*(1+eQ_i))(K*(1+eK_i))^T = (Q*(1+eQ_i)*(1+eK_i)) K^T, so head i's rows are
        W^Q scaled by f_i = (1+eQ_i)(1+eK_i) (bias b^Q * f_i). MHE-Add: (Q+eQ_i)(K+eK_i)^T
        differs from (Q+eQ_i) K^T by a term constant along the keys, which softmax cancels, so
        head i's rows are W^Q itself and its bias is b^Q + eQ_i (paper-notes' identities).
        """
        if self.rotary is not None:
            raise MheError("MHE under rotary positions applies its per-head query factors after the rotation; an "
                           "(n*d) x m query weight would apply them before it, which is exact only where every factor "
                           "is equal within each rotary pair: this sublayer has no folded multi-query form")
        n, d = self.cfg.n_heads, self.cfg.head_dim
        f = self._query_factors()  # [n, d]
        w, bias = self.q_proj.weight, self.q_proj.bias  # [d, m], [d]
        if self.multiplicative:
            w_all = (f[:, :, None] * w[None]).reshape(n * d, self.cfg.d_model)  # [n*d, m]
            return w_all, None if bias is None else (f * bias).reshape(n * d)
        w_all = w.repeat(n, 1)  # [n*d, m]
        return w_all, f.reshape(n * d) if bias is None else (f + bias).reshape(n * d)

    def folded_output(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output weight ``[m, n*d]`` and bias ``[m]`` (None when there is none) that take
        the heads' outputs over the shared V to this module's output (see the subclasses)."""
        raise NotImplementedError

    def _fast_queries(self, x: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        c = self.cfg
        n, d = c.n_heads, c.head_dim
        b, t, _ = x.shape
        if c.options.query_fold == "activation" or self.rotary is not None:
            # rotate the shared query, then apply the per-head factors (RoPE, then psi)
            q = self._rotate(self.q_proj(x).unsqueeze(1), positions)  # [B, 1, T, d]
            return self._psi_factor(q, self._query_factors())  # [B, n, T, d]
        w_all, b_all = self.folded_query()  # [n*d, m], [n*d]
        return F.linear(x, w_all, b_all).view(b, t, n, d).transpose(1, 2)  # [B, n, T, d]

    def _psi_factor(self, a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """``a [B, 1, T, d]`` with the per-head factor or offset ``f [n, d]`` -> ``[B, n, T, d]``,
        laid out ``[B, T, n, d]`` in memory as every kind's split query heads are (``_split_heads``),
        so the attention kernel reads, and writes its output, as it does for MQA, and the heads merge
        without a copy."""
        a = a.transpose(1, 2)  # [B, T, 1, d]
        if self.multiplicative and torch.is_grad_enabled() and (a.requires_grad or f.requires_grad):
            return _scaled_heads(a, f).transpose(1, 2)
        return (a * f if self.multiplicative else a + f).transpose(1, 2)  # [B, T, n, d] -> [B, n, T, d]

    def _fast_output(self, h: torch.Tensor) -> torch.Tensor:
        kept = fused_output(self)
        w, bias = self.folded_output() if kept is None else kept
        return F.linear(self._merge_heads(h), w, bias)


def _scaled_heads(a: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``a [B, T, 1, d] * f [n, d] -> [B, T, n, d]`` as one matrix product with a block-diagonal
    matrix whose block i is diag(f_i). Under autograd this is the faster form: the backward's
    sums over the n heads (dA) and over the B*T rows (df) become two matrix products, which read
    the n-head query gradient at the card's bandwidth, where the sums written out as reductions
    over a strided axis did not (docs/benchmarks.md section 11).

    The product runs in ``a``'s dtype, or autocast's (bf16), which would round the float32
    factors before multiplying. So ``f`` enters as two terms in that dtype, ``f_hi`` (f rounded)
    and ``f_lo`` (the rest, rounded), stacked along the contraction (``[a, a] @ [F_hi; F_lo]``,
    ``[2d, n*d]``): the product accumulates ``a*f_hi + a*f_lo`` in float32 and rounds once, as
    ``a * f`` with float32 factors does, to within ``f``'s float32 rounding. In float64 it equals
    ``a * f`` exactly."""
    b, t, _, d = a.shape
    n = f.shape[0]
    dtype = torch.get_autocast_dtype(a.device.type) if torch.is_autocast_enabled(a.device.type) else a.dtype
    hi = f.to(dtype)
    terms = torch.stack([hi, (f - hi.to(f.dtype)).to(dtype)])  # [2, n, d]
    eye = torch.eye(d, dtype=dtype, device=f.device)
    blocks = eye[None, :, None, :] * terms[:, None]  # [2, d, n, d]: [k, j', i, j] = term_k[i, j] if j = j'
    x = a.reshape(b * t, d)
    return torch.matmul(torch.cat([x, x], -1), blocks.reshape(2 * d, n * d)).view(b, t, n, d)


class MHEMul(_MHEBase):
    """MHE-Mul: psi(A, e) = A * (e + 1) (section 3.4). See the module docstring."""

    multiplicative = True

    def _query_factors(self):
        scale_q, scale_k = (self.head_embed[:2] + 1).unbind(0)  # one add, one backward node (fewer kernels)
        return scale_q * scale_k  # [n, d]: query scale times key scale

    def folded_output(self):
        """A_i (V*(1+eV_i)) = (A_i V)*(1+eV_i): the value scales move into the columns of W^O."""
        return self.out_proj.weight * (self.head_embed[2] + 1).reshape(1, -1), self.out_proj.bias  # [m, n*d]


class MHEAdd(_MHEBase):
    """MHE-Add: psi(A, e) = A + e (section 3.4). See the module docstring."""

    def _query_factors(self):
        return self.head_embed[0]  # the key offsets cancel in softmax

    def _expands_values(self) -> bool:
        return self.training and self.cfg.dropout > 0

    def _attend(self, q, k, v, mask, kernel):
        if not self.literal and self._expands_values():
            n = self.cfg.n_heads
            v = v + self.head_embed[2][None, :, None, :]  # [B, n, S, d]
            k = k.expand(-1, n, -1, -1)
        return super()._attend(q, k, v, mask, kernel)

    def folded_output(self):
        """A_i (V + 1 eV_i^T) = A_i V + eV_i^T when attention rows sum to one (no attention
        dropout): the value offsets become the output bias b^O + W^O eV."""
        bias = self.out_proj.bias
        # [m] = W^O eV, as a product of elements and a sum: no matrix product, so neither autocast
        # nor a TF32 setting rounds it (an inference view keeps it made once: fused_projections)
        offset = (self.out_proj.weight * self.head_embed[2].reshape(1, -1)).sum(-1)
        return self.out_proj.weight, offset if bias is None else bias + offset

    def _fast_output(self, h):
        if self._expands_values():  # the values already carry their offsets (see _attend)
            return F.linear(self._merge_heads(h), self.out_proj.weight, self.out_proj.bias)
        return super()._fast_output(h)
