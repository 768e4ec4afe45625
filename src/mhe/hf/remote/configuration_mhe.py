"""The configuration of an exported mhe model (multi-head embedding attention and the kinds it
is compared with; Xue & Aletras, "Pit One Against Many", Findings of EMNLP 2023).

Standalone: this file and ``modeling_mhe.py`` travel with the exported folder and need only
torch and transformers. ``mhe`` holds the model's whole configuration as mhe wrote it (its
``ModelConfig``: architecture, widths, attention kind and options, positions, norms); the
fields transformers' utilities read (``hidden_size``, ``num_hidden_layers``, ...) are derived
from it.
"""

from __future__ import annotations

from transformers import PretrainedConfig

_BASE = {"arch": "decoder", "head": "lm", "vocab_size": 1024, "d_model": 64, "n_layers": 2, "n_heads": 4,
         "d_ff": 256, "max_len": 128, "attention": "mha", "attn_options": {}}


class MheConfig(PretrainedConfig):
    """``mhe``: the model settings (keys of mhe's ``ModelConfig``); everything else is derived."""

    model_type = "mhe"
    mhe: dict | None = None
    use_cache: bool = True
    vocab_size: int = 1024
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    head_dim: int = 16
    max_position_embeddings: int = 128
    attention_kind: str = "mha"

    def __post_init__(self, **kwargs):
        s = self.mhe = {**_BASE, **(self.mhe or {})}
        s["attn_options"] = dict(s.get("attn_options") or {})
        self.vocab_size = s["vocab_size"]
        self.hidden_size = s["d_model"]
        self.intermediate_size = s["d_ff"]
        self.num_hidden_layers = s["n_layers"]
        self.num_attention_heads = s["n_heads"]
        self.head_dim = s.get("head_dim") or s["d_model"] // s["n_heads"]
        self.num_key_value_heads = cache_heads(s)
        self.max_position_embeddings = s["max_len"]
        self.attention_kind = s["attention"]
        self.is_encoder_decoder = s["arch"] == "encoder-decoder"
        self.tie_word_embeddings = bool(s.get("tie_embeddings", True))
        if KINDS[s["attention"]][1] == "mixing":  # they mix whole sequences: no K/V to cache
            self.use_cache = False
        if getattr(self, "pad_token_id", None) is None:
            self.pad_token_id = s.get("pad_id", 0)
        super().__post_init__(**kwargs)


KINDS = {
    "mha": ("n", "heads", ""), "sha": ("1", "seed", ""), "mqa": ("1", "heads", ""), "gqa": ("g", "heads", ""),
    "skv": ("n", "shared", ""), "el-att": ("n", "input", ""), "mhe-add": ("1", "seed", "add"),
    "mhe-mul": ("1", "seed", "mul"), "fnet": ("0", "mixing", ""), "linear": ("0", "mixing", ""),
}
"""The one table of attention kinds here (this folder cannot import mhe's specs): kind -> (its K/V
heads: ``n``, ``g`` (gqa's ``n_kv_heads``), ``1`` or ``0``; its projections: ``heads`` (n query
heads over g K/V heads), ``shared`` (skv: K = V), ``input`` (el-att: the input is K and V),
``seed`` (one d-wide query, key and value: sha, MHE) or ``mixing`` (fnet, linear); MHE's psi,
``add`` or ``mul``)."""


def cache_heads(s: dict) -> int:
    """The K/V heads a self-attention layer caches: n for mha, skv, el-att and MHE with
    psi-then-rope under rotary positions, g for gqa, 1 for mqa, sha and other MHE (one shared
    K/V head, the paper's section 3 identities), 0 for the mixing kinds."""
    n, opts = s["n_heads"], s.get("attn_options") or {}
    heads, _, psi = KINDS[s["attention"]]
    if psi:
        literal = s.get("positions") == "rotary" and opts.get("rope_order") == "psi-then-rope"
        return n if literal else 1
    if heads == "g":
        return opts.get("n_kv_heads") or _default_kv_heads(n)
    return {"n": n, "1": 1, "0": 0}[heads]


def _default_kv_heads(n: int) -> int:
    """gqa's default: the largest divisor of n not above n/4 (as mhe picks it)."""
    return max(g for g in range(1, max(1, n // 4) + 1) if n % g == 0)
