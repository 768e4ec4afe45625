"""MHA, MQA and GQA (one class: g key/value heads for n query heads) and SKV."""

from __future__ import annotations

from torch import nn

from mhe.attention.base import Attention, AttentionConfig
from mhe.attention.fused_projections import fused_projection
from mhe.attention.options import GroupedQueryOptions, default_kv_heads  # noqa: F401 (re-exported)


class GroupedQueryAttention(Attention):
    """Multi-head attention whose n query heads share g key/value heads, in groups of n/g.

    * ``mha``, g = n: multi-head attention (Vaswani et al. 2017; paper section 3.1, Eqs. 1-3),
      each head i with its own W_i^Q, W_i^K, W_i^V in R^{m x d};
    * ``mqa``, g = 1: multi-query attention (Shazeer 2019), one key and one value head;
    * ``gqa``, g = ``n_kv_heads``: grouped-query attention (Ainslie et al. 2023).

    The kind fixes g (mha, mqa) or takes it from its options (gqa); its spec says which
    (:meth:`~mhe.attention.spec.AttentionSpec.kv_heads`).
    Parameters: m*n*d (Q) + 2*m*g*d (K, V) + n*d*m (output): 4m^2 for MHA when m = n*d;
    Table 4 (no output projection): 3 d^2 n^2 (MHA), d^2 n^2 + 2 d^2 n (MQA).
    """

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        super().__init__(cfg, kind=kind)
        self.n_kv_heads = self.spec.kv_heads(cfg.n_heads, cfg.options)
        m, nd = cfg.d_model, cfg.inner_dim
        self.q_proj = nn.Linear(m, nd, bias=cfg.in_bias)
        self._make_kv(cfg)
        self.out_proj = nn.Linear(nd, m, bias=cfg.bias)

    def _make_kv(self, cfg: AttentionConfig) -> None:
        kv = self.n_kv_heads * cfg.head_dim
        self.k_proj = nn.Linear(cfg.d_model, kv, bias=cfg.in_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv, bias=cfg.in_bias)

    def _queries(self, x, positions):
        return self._rotate(self._split_heads(self.q_proj(x), self.cfg.n_heads), positions)  # [B, n, T, d]

    def _keys_values(self, src, positions):
        g = self.n_kv_heads
        k, v = self._split_heads(self.k_proj(src), g), self._split_heads(self.v_proj(src), g)  # [B, g, S, d]
        return self._rotate(k, positions), v

    def _output(self, h):
        return self.out_proj(self._merge_heads(h))  # [B, T, m]

    def _step_product(self, x):
        """The fused view's product (MHA, GQA, MQA; SKV and EL-att make theirs otherwise): its
        queries and keys are rotated last."""
        fused = fused_projection(self)
        return None if fused is None else (fused(x), self.cfg.n_heads, self.n_kv_heads)

    def projections_to_fuse(self):
        own = type(self)._queries is GroupedQueryAttention._queries and \
            type(self)._keys_values is GroupedQueryAttention._keys_values  # not SKV's, EL-att's
        return (self.q_proj, self.k_proj, self.v_proj) if own else None

    def _self_projections(self, x, positions):
        fused = fused_projection(self)
        if fused is None:
            return super()._self_projections(x, positions)
        n, g, d = self.cfg.n_heads, self.n_kv_heads, self.cfg.head_dim
        q, k, v = fused(x).split([n * d, g * d, g * d], -1)  # [B, T, n*d], 2 x [B, T, g*d]
        q, k = self._split_heads(q, n), self._split_heads(k, g)
        return self._rotate(q, positions), self._rotate(k, positions), self._split_heads(v, g)


class SharedKeyValueAttention(GroupedQueryAttention):
    """Shared key-value attention (Kitaev et al. 2020, Reformer): K = V = X W^{KV}.

    Parameters: m*n*d (Q) + m*n*d (shared K/V) + n*d*m (output); Table 4: 2 d^2 n^2.
    """

    def _make_kv(self, cfg: AttentionConfig) -> None:
        self.kv_proj = nn.Linear(cfg.d_model, cfg.inner_dim, bias=cfg.in_bias)

    def _keys_values(self, src, positions):
        kv = self._split_heads(self.kv_proj(src), self.cfg.n_heads)  # [B, n, S, d]
        return self._rotate(kv, positions), kv  # K = V before the rotation; values are not rotated
