"""The attention zoo: every kind behind one contract (see :mod:`mhe.attention.base`), listed by
name in :mod:`mhe.attention.spec` (one spec per kind).

Names are imported on first use (PEP 562): the kinds' specs and their options
(:mod:`mhe.attention.spec`, :mod:`mhe.attention.options`) come without torch, the sublayers with it.
"""

import importlib

_WHERE = {
    "Attention": "base", "set_kernel": "base",
    "AttentionConfig": "options", "NoOptions": "options", "MHEOptions": "options", "LinearOptions": "options",
    "GroupedQueryOptions": "options", "KINDS": "spec", "PAPER_KINDS": "spec", "make_config": "spec",
    "options_class": "spec", "parse_kinds": "spec", "AttentionSpec": "spec", "SPECS": "spec",
    "attention_spec": "spec", "parse_specs": "spec",
    "KERNELS": "kernels", "register_kernel": "kernels",
    "CachePosition": "kv_cache", "CrossCache": "kv_cache", "KVCache": "kv_cache", "layer_caches": "kv_cache",
    "AttentionMask": "masks",
    "attention_class": "registry", "attention_from_config": "registry",
    "build_attention": "registry",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"mhe.attention.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mhe.attention' has no attribute {name!r}")
