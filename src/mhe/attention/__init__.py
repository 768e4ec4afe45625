"""The attention zoo: every kind behind one contract (see :mod:`mhe.attention.base`).

Importing the package imports every variant module, whose ``@register`` decorators fill the
registry (:mod:`mhe.attention.registry` holds only the table)."""

from mhe.attention.base import Attention, AttentionConfig, set_kernel
from mhe.attention.kernels import KERNELS, register_kernel
from mhe.attention.kv_cache import CrossCache, KVCache
from mhe.attention.masks import AttentionMask
from mhe.attention.registry import (
    KINDS,
    PAPER_KINDS,
    attention_class,
    build_attention,
    make_config,
    parse_kinds,
)

# the variant modules: importing them registers their kinds
from mhe.attention import el_attention, mhe, mixing, multi_head, single_head  # noqa: F401, E402  isort: skip

__all__ = ["Attention", "AttentionConfig", "AttentionMask", "CrossCache", "KERNELS", "KVCache", "KINDS",
           "PAPER_KINDS", "attention_class", "build_attention", "make_config", "parse_kinds", "register_kernel",
           "set_kernel"]
