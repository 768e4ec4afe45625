"""What an attention kind is configured with, without torch: the options every kind shares
(:class:`AttentionConfig`), each kind's own options dataclass (``model.attn_options``) and the
rules that resolve them (GQA's default grouping, the rotary width).

The model configuration, ``mhe params`` and ``mhe memory`` need only this and the kinds' specs
(:mod:`mhe.attention.spec`, which names each kind's options dataclass), so they start without
importing torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from mhe.errors import MheError, one_of, require_positive
from mhe.settings import setting

@dataclass(frozen=True)
class NoOptions:
    """The options of a kind with no knobs beyond the shared ones (mha, sha, mqa, skv, el-att, fnet)."""


@dataclass(frozen=True, kw_only=True)
class AttentionConfig:
    """Options every attention kind shares.

    Attributes:
        d_model: model width m.
        n_heads: number of heads n.
        head_dim: per-head width d; defaults to m / n (then n must divide m).
        dropout: dropout on the attention probabilities (training only).
        causal: mask future positions in self-attention.
        bias: give every projection a bias (the paper's counts exclude biases).
        qkv_bias: give the query, key and value projections biases even where ``bias`` is
            False (Qwen2: biased Q/K/V, unbiased output).
        kernel: how the attention step is computed, a name in
            :data:`mhe.attention.kernels.KERNELS` (``sdpa``, ``eager``, ...); it never
            changes the function, only how it runs.
        options: the kind's own knobs, its options dataclass (the one ``--set
            model.attn_options.*`` fills; :attr:`mhe.attention.spec.AttentionSpec.options`).
    """

    d_model: int
    n_heads: int
    head_dim: int | None = None
    dropout: float = 0.0
    causal: bool = False
    bias: bool = False
    qkv_bias: bool = False
    kernel: str = "sdpa"
    options: object = NoOptions()

    def __post_init__(self) -> None:
        require_positive(d_model=self.d_model, n_heads=self.n_heads)
        if self.kernel != "sdpa":  # the built-in default; another name is looked up in the kernel registry
            from mhe.attention.kernels import check_kernel

            check_kernel(self.kernel)
        if not dataclasses.is_dataclass(self.options) or isinstance(self.options, type):
            raise MheError(f"options must be an attention kind's options dataclass, got {self.options!r}")
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise MheError(
                    f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "pass head_dim explicitly or choose n_heads dividing d_model"
                )
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        require_positive(head_dim=self.head_dim)
        for name in ("causal", "bias", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise MheError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)):
            raise MheError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise MheError(f"dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def in_bias(self) -> bool:
        """Whether the query, key and value projections carry biases."""
        return self.bias or self.qkv_bias

    @property
    def inner_dim(self) -> int:
        """n * d, the width of the concatenated heads."""
        return self.n_heads * self.head_dim


def default_kv_heads(n_heads: int) -> int:
    """GQA's default number of key/value heads: the largest divisor of ``n_heads`` not above n/4
    (12 heads: 3, 16: 4, 8: 2; 4 or fewer: 1).

    One quarter keeps GQA between its two limits, MQA (g = 1) and MHA (g = n), as Ainslie et
    al. (2023) use it (e.g. 8 groups of 64 heads is n/8; n/4 is the middle ground common in
    released models); a default of 1 would only repeat MQA. Models, ``mhe params`` and
    ``mhe memory`` all take it from here (through :meth:`mhe.attention.spec.AttentionSpec.kv_heads`).
    """
    require_positive(n_heads=n_heads)
    limit = max(1, n_heads // 4)
    return max(g for g in range(1, limit + 1) if n_heads % g == 0)


@dataclass(frozen=True)
class GroupedQueryOptions:
    """gqa's own options (``model.attn_options``).

    Attributes:
        n_kv_heads: the key/value heads g (Ainslie et al. 2023), which must divide
            ``n_heads``; 0 picks :func:`default_kv_heads`.
    """

    n_kv_heads: int = setting(0, ge=0)

    def __post_init__(self) -> None:
        if self.n_kv_heads != 0 or isinstance(self.n_kv_heads, bool):
            require_positive(n_kv_heads=self.n_kv_heads)


IMPLS = ("fast", "reference")
QUERY_FOLDS = ("weight", "activation")
ROPE_ORDERS = ("rope-then-psi", "psi-then-rope")


@dataclass(frozen=True)
class MHEOptions:
    """MHE's own options (``model.attn_options``); a new one is one field here.

    Attributes:
        impl: ``"fast"`` (multi-query cost) or ``"reference"`` (literal equations).
        init_std: standard deviation of the head-embedding initialisation.
        query_fold: how the fast path applies per-head query factors (without rotary positions).
        rope_order: under rotary positions, whether the head embeddings act after the rotation
            (``rope-then-psi``: one shared K/V head) or before it (``psi-then-rope``: n heads).
    """

    impl: Literal[IMPLS] = "fast"
    init_std: float = setting(0.02, ge=0)
    query_fold: Literal[QUERY_FOLDS] = "weight"
    rope_order: Literal[ROPE_ORDERS] = "rope-then-psi"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise one_of("MHE impl", self.impl, IMPLS)
        if self.query_fold not in QUERY_FOLDS:
            raise one_of("MHE query_fold", self.query_fold, QUERY_FOLDS)
        if self.rope_order not in ROPE_ORDERS:
            raise one_of("MHE rope_order", self.rope_order, ROPE_ORDERS)
        if not self.init_std >= 0:
            raise MheError(f"init_std must be >= 0, got {self.init_std!r}")


@dataclass(frozen=True)
class LinearOptions:
    """linear's own options (``model.attn_options``).

    Attributes:
        max_len: the side of the sequence-mixing matrix; None takes the model's ``max_len``
            (:attr:`resolved_max_len` when the sublayer is built on its own).
    """

    max_len: int | None = setting(None, gt=0)

    def __post_init__(self) -> None:
        if self.max_len is not None:
            require_positive(max_len=self.max_len)

    @property
    def resolved_max_len(self) -> int:
        return 512 if self.max_len is None else self.max_len


def rotary_width(head_dim: int, fraction: float) -> int:
    """The rotated width ``r = int(fraction * head_dim)``; it must be even and positive."""
    if not 0.0 < fraction <= 1.0:
        raise MheError(f"rope_fraction must be in (0, 1], got {fraction!r}")
    r = int(head_dim * fraction)
    if r < 2 or r % 2:
        raise MheError(f"rope_fraction={fraction} rotates {r} of head_dim={head_dim} dimensions; "
                       "the rotated width must be even and at least 2")
    return r
