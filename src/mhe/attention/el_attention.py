"""EL-attention: keys and values are the input itself, no K/V projections."""

from __future__ import annotations

from mhe.attention.base import AttentionConfig
from mhe.attention.multi_head import GroupedQueryAttention
from mhe.errors import MheError


class ELAttention(GroupedQueryAttention):
    """EL-attention (Yan et al. 2021) as counted in the paper (section 4.1, Table 4).

    The projections of keys and values are eliminated: head i attends with its
    projected query over the i-th d-wide slice of the input, which serves as
    both key and value. This needs m = n*d. Parameters: m*n*d (Q) + n*d*m
    (output); Table 4: d^2 n^2 without the output projection.
    """

    def __init__(self, cfg: AttentionConfig, *, kind: str | None = None) -> None:
        if cfg.inner_dim != cfg.d_model:
            raise MheError(
                f"el-att uses the input as keys and values, so n_heads*head_dim must equal d_model; "
                f"got {cfg.n_heads}*{cfg.head_dim} != {cfg.d_model}"
            )
        super().__init__(cfg, kind=kind)

    def _make_kv(self, cfg: AttentionConfig) -> None:
        pass  # no key or value projection

    def _keys_values(self, src, positions):
        kv = self._split_heads(src, self.cfg.n_heads)  # [B, n, S, d]
        return self._rotate(kv, positions), kv  # the keys rotated, the values as they are
