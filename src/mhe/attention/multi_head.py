"""MHA, GQA, MQA and SKV: per-head query projections, differing key/value sharing."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mhe.attention.base import Attention, AttentionConfig
from mhe.attention.registry import register
from mhe.errors import MheError, require_positive


@register("mha")
class MultiHeadAttention(Attention):
    """Multi-head attention (Vaswani et al. 2017; paper section 3.1, Eqs. 1-3).

    Each head i has its own W_i^Q, W_i^K, W_i^V in R^{m x d}.
    Parameters: 3*m*n*d (Q, K, V) + n*d*m (output) = 4m^2 when m = n*d.
    """

    def __init__(self, cfg: AttentionConfig) -> None:
        super().__init__(cfg)
        m, nd = cfg.d_model, cfg.inner_dim
        self.q_proj = nn.Linear(m, nd, bias=cfg.in_bias)
        self._make_kv(cfg)
        self.out_proj = nn.Linear(nd, m, bias=cfg.bias)

    def _make_kv(self, cfg: AttentionConfig) -> None:
        kv = self.cache_heads * cfg.head_dim
        self.k_proj = nn.Linear(cfg.d_model, kv, bias=cfg.in_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv, bias=cfg.in_bias)

    @property
    def cache_heads(self) -> int:
        return self.cfg.n_heads

    def _queries(self, x, positions):
        return self._rotate(self._split_heads(self.q_proj(x), self.cfg.n_heads), positions)  # [B, n, T, d]

    def _keys_values(self, src, positions):
        h = self.cache_heads
        return self._rotate(self._split_heads(self.k_proj(src), h), positions), self._split_heads(self.v_proj(src), h)

    def _output(self, h):
        return self.out_proj(self._merge_heads(h))  # [B, T, m]


def default_kv_heads(n_heads: int) -> int:
    """GQA's default number of key/value heads: the largest divisor of ``n_heads`` not above n/4
    (12 heads: 3, 16: 4, 8: 2; 4 or fewer: 1).

    One quarter keeps GQA between its two limits, MQA (g = 1) and MHA (g = n), as Ainslie et
    al. (2023) use it (e.g. 8 groups of 64 heads is n/8; n/4 is the middle ground common in
    released models); a default of 1 would only repeat MQA. Models, ``mhe params`` and
    ``mhe memory`` all take it from here.
    """
    require_positive(n_heads=n_heads)
    limit = max(1, n_heads // 4)
    return max(g for g in range(1, limit + 1) if n_heads % g == 0)


@dataclass(frozen=True, kw_only=True)
class GroupedQueryConfig(AttentionConfig):
    """Adds ``n_kv_heads``, the number of key/value heads (must divide n_heads; 0 or unset:
    :func:`default_kv_heads`)."""

    n_kv_heads: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_kv_heads == 0:
            object.__setattr__(self, "n_kv_heads", default_kv_heads(self.n_heads))
        require_positive(n_kv_heads=self.n_kv_heads)
        if self.n_heads % self.n_kv_heads:
            raise MheError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")


@register("gqa")
class GroupedQueryAttention(MultiHeadAttention):
    """Grouped-query attention (Ainslie et al. 2023): n query heads share g key/value heads.

    Parameters: m*n*d (Q) + 2*m*g*d (K, V) + n*d*m (output). g = 1 is MQA, g = n is MHA.
    """

    config_class = GroupedQueryConfig

    @property
    def cache_heads(self) -> int:
        return self.cfg.n_kv_heads


@dataclass(frozen=True, kw_only=True)
class MultiQueryConfig(AttentionConfig):
    pass


@register("mqa")
class MultiQueryAttention(MultiHeadAttention):
    """Multi-query attention (Shazeer 2019): one key and one value head shared by all queries.

    Parameters: m*n*d (Q) + 2*m*d (K, V) + n*d*m (output); Table 4: d^2 n^2 + 2 d^2 n
    without the output projection.
    """

    config_class = MultiQueryConfig

    @property
    def cache_heads(self) -> int:
        return 1


@register("skv")
class SharedKeyValueAttention(MultiHeadAttention):
    """Shared key-value attention (Kitaev et al. 2020, Reformer): K = V = X W^{KV}.

    Parameters: m*n*d (Q) + m*n*d (shared K/V) + n*d*m (output); Table 4: 2 d^2 n^2.
    """

    def _make_kv(self, cfg: AttentionConfig) -> None:
        self.kv_proj = nn.Linear(cfg.d_model, cfg.inner_dim, bias=cfg.in_bias)

    def _keys_values(self, src, positions):
        kv = self._split_heads(self.kv_proj(src), self.cfg.n_heads)  # [B, n, S, d]
        return self._rotate(kv, positions), kv  # K = V before the rotation; values are not rotated


