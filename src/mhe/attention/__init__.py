"""The attention zoo: every kind behind one contract (see :mod:`mhe.attention.base`), listed by
name in :mod:`mhe.attention.registry`."""

from mhe.attention.base import Attention, AttentionConfig, NoOptions, set_kernel
from mhe.attention.kernels import KERNELS, register_kernel
from mhe.attention.kv_cache import CachePosition, CrossCache, KVCache, layer_caches
from mhe.attention.masks import AttentionMask
from mhe.attention.mhe import MHEOptions
from mhe.attention.mixing import LinearOptions
from mhe.attention.multi_head import GroupedQueryOptions
from mhe.attention.registry import (
    ATTENTION_CLASSES,
    KINDS,
    PAPER_KINDS,
    attention_class,
    attention_from_config,
    build_attention,
    make_config,
    options_class,
    parse_kinds,
)

__all__ = ["ATTENTION_CLASSES", "Attention", "AttentionConfig", "AttentionMask", "CachePosition", "CrossCache",
           "GroupedQueryOptions", "KERNELS", "KVCache", "KINDS", "LinearOptions", "MHEOptions", "NoOptions",
           "PAPER_KINDS", "attention_class", "attention_from_config", "build_attention", "make_config", "options_class", "parse_kinds",
           "register_kernel", "layer_caches", "set_kernel"]
