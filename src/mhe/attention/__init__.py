"""The attention zoo: every kind behind one contract (see :mod:`mhe.attention.base`)."""

from mhe.attention.base import Attention, AttentionConfig, KVCache
from mhe.attention.kernels import KERNELS, register_kernel
from mhe.attention.registry import (
    KINDS,
    PAPER_KINDS,
    attention_class,
    build_attention,
    make_config,
    parse_kinds,
)

__all__ = ["Attention", "AttentionConfig", "KERNELS", "KVCache", "KINDS", "PAPER_KINDS",
           "attention_class", "build_attention", "make_config", "parse_kinds", "register_kernel"]
