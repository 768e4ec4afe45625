"""Hugging Face Llama, Qwen2 and Mistral causal language models <-> ``mhe`` Llama-style decoders.

The three share one layout (``transformers``' ``modeling_llama.py``, ``modeling_qwen2.py``,
``modeling_mistral.py``): token embeddings, then per layer RMSNorm -> attention with rotary
positions (half-split pairs, ``rotate_half``) over grouped K/V heads -> residual, RMSNorm ->
SwiGLU (``down(silu(gate(x)) * up(x))``) -> residual; a final RMSNorm and the output head, tied
or not. Every weight is an ``nn.Linear`` on both sides, so the map only renames:

===================================  ===================================
Hugging Face                         ``mhe``
===================================  ===================================
``model.embed_tokens``               ``decoder.embed.tokens``
``model.layers.i.self_attn.q_proj``  ``decoder.layers.i.self_attn.q_proj`` (k, v likewise)
``model.layers.i.self_attn.o_proj``  ``decoder.layers.i.self_attn.out_proj``
``model.layers.i.mlp.gate_proj``     ``decoder.layers.i.ffn.gate`` (up, down likewise)
``model.layers.i.input_layernorm``   ``decoder.layers.i.self_norm``
``...post_attention_layernorm``      ``decoder.layers.i.ffn_norm``
``model.norm``, ``lm_head``          ``decoder.final_norm``, ``lm_head``
===================================  ===================================

The differences are in the configuration: Llama's ``attention_bias`` biases all four attention
projections (``model.attn_bias``); Qwen2 always biases Q, K and V and never the output
(``model.qkv_bias``); Mistral has no biases. K/V heads: as many as query heads is ``mha``, one is
``mqa``, else ``gqa`` with ``n_kv_heads``. A sliding attention window (Mistral, Qwen2's
``use_sliding_window``) has no ``mhe`` equivalent and is refused, as are RoPE scalings other than
the default and Llama's MLP biases.
"""

from __future__ import annotations

from mhe.errors import MheError
from mhe.models import ModelConfig

LLAMA_CLASSES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

_LAYER_NAMES = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.k_proj",
                "self_attn.v_proj": "self_attn.v_proj", "self_attn.o_proj": "self_attn.out_proj",
                "mlp.gate_proj": "ffn.gate", "mlp.up_proj": "ffn.up", "mlp.down_proj": "ffn.down",
                "input_layernorm": "self_norm", "post_attention_layernorm": "ffn_norm"}


def _rope_base(c, name: str) -> float:
    rope = dict(getattr(c, "rope_parameters", None) or {})
    kind = rope.get("rope_type", "default")
    if kind != "default":
        raise MheError(f"{name}: rope_type {kind!r} is not supported; mhe's rotary positions are the default RoPE")
    return float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _refuse(c, name: str) -> None:
    window = getattr(c, "sliding_window", None)
    if window is not None or "sliding_attention" in (getattr(c, "layer_types", None) or ()):
        raise MheError(f"{name}: sliding_window={window} has no mhe equivalent; set config.sliding_window=None "
                       "(the same function for sequences up to the window)")
    if getattr(c, "mlp_bias", False):
        raise MheError(f"{name}: mlp_bias=True has no mhe equivalent (SwiGLU without biases)")
    if getattr(c, "hidden_act", "silu") != "silu":
        raise MheError(f"{name}: hidden_act={c.hidden_act!r} is not supported; SwiGLU takes silu")


def llama_model_config(c, name: str) -> ModelConfig:
    """A ``LlamaConfig``, ``Qwen2Config`` or ``MistralConfig`` as a :class:`ModelConfig`."""
    _refuse(c, name)
    n, g = c.num_attention_heads, c.num_key_value_heads or c.num_attention_heads
    kind, opts = ("mha", None) if g == n else ("mqa", None) if g == 1 else ("gqa", {"n_kv_heads": g})
    head_dim = getattr(c, "head_dim", None)
    qwen = name.startswith("Qwen2")
    return ModelConfig(
        arch="decoder", head="lm", vocab_size=c.vocab_size, d_model=c.hidden_size, n_layers=c.num_hidden_layers,
        n_heads=n, head_dim=None if head_dim in (None, c.hidden_size // n) else head_dim,
        d_ff=c.intermediate_size, max_len=c.max_position_embeddings, attention=kind, attn_options=opts,
        attn_bias=bool(getattr(c, "attention_bias", False)) and not qwen, qkv_bias=qwen, dropout=0.0,
        attn_dropout=float(getattr(c, "attention_dropout", 0.0) or 0.0), norm_first=True, norm="rmsnorm",
        mlp="swiglu", positions="rotary", rope_base=_rope_base(c, name), layer_norm_eps=c.rms_norm_eps,
        tie_embeddings=bool(c.tie_word_embeddings), pad_id=c.pad_token_id or 0)


def llama_class(cfg: ModelConfig, family: str | None = None) -> str:
    """The Hugging Face class an exportable Llama-style ``cfg`` becomes: ``family`` when given
    (``llama``, ``qwen2`` or ``mistral``), else Qwen2 for Q/K/V biases without an output bias
    and Llama otherwise."""
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
    if family is None:
        family = "qwen2" if cfg.qkv_bias and not cfg.attn_bias else "llama"
    if family not in names:
        raise MheError(f"unknown Hugging Face family {family!r}; valid: {', '.join(names)}")
    qkv_only = cfg.qkv_bias and not cfg.attn_bias
    fits = {"llama": not qkv_only, "qwen2": qkv_only, "mistral": not (cfg.attn_bias or cfg.qkv_bias)}[family]
    if not fits:
        raise MheError(f"a {names[family]} cannot hold this model's attention biases (model.attn_bias="
                       f"{cfg.attn_bias}, model.qkv_bias={cfg.qkv_bias})")
    return names[family]


def check_llama_exportable(cfg: ModelConfig) -> None:
    """The model is the Llama-style decoder these classes hold (else one line naming the setting)."""
    want = {"arch": "decoder", "head": "lm", "positions": "rotary", "norm": "rmsnorm", "mlp": "swiglu",
            "norm_first": True, "rope_fraction": 1.0, "adaptive_cutoffs": []}
    for key, value in want.items():
        if getattr(cfg, key) != value:
            raise MheError(f"only Llama-style decoders export to Llama/Qwen2/Mistral: model.{key} is "
                           f"{getattr(cfg, key)!r}, needs {value!r}")
    if not cfg.spec.head_groups:
        raise MheError(f"only mha, gqa and mqa attention export to Llama/Qwen2/Mistral, got {cfg.attention!r}")


def llama_hf_config(cfg: ModelConfig, cls_name: str):
    """The ``transformers`` configuration of an exportable Llama-style ``cfg``."""
    import transformers

    check_llama_exportable(cfg)
    g = cfg.spec.kv_heads(cfg.n_heads, cfg.attn_options)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=g,
                  head_dim=cfg.resolved_head_dim, max_position_embeddings=cfg.max_len, rms_norm_eps=cfg.layer_norm_eps,
                  rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_base},
                  tie_word_embeddings=cfg.tie_embeddings, attention_dropout=cfg.attn_dropout, hidden_act="silu",
                  pad_token_id=cfg.pad_id, bos_token_id=None, eos_token_id=None)
    if cls_name == "LlamaForCausalLM":
        return transformers.LlamaConfig(attention_bias=cfg.attn_bias, mlp_bias=False, **common)
    if cls_name == "Qwen2ForCausalLM":
        return transformers.Qwen2Config(use_sliding_window=False, **common)
    return transformers.MistralConfig(sliding_window=None, **common)


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Hugging Face parameter prefix -> mhe parameter prefix."""
    out = {"model.embed_tokens": "decoder.embed.tokens", "model.norm": "decoder.final_norm", "lm_head": "lm_head"}
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{h}": f"decoder.layers.{i}.{o}" for h, o in _LAYER_NAMES.items()})
    return out


def _renamed(sd: dict, names: dict[str, str]) -> dict:
    """The weights and biases of ``sd`` whose prefix ``names`` maps, under the mapped prefix."""
    return {f"{new}.{leaf}": sd[f"{old}.{leaf}"] for old, new in names.items() for leaf in ("weight", "bias")
            if f"{old}.{leaf}" in sd}


def llama_to_mhe(sd: dict, cfg: ModelConfig) -> dict:
    """A Hugging Face Llama/Qwen2/Mistral state dict under ``mhe``'s names."""
    out = _renamed(sd, _names(cfg))
    out.setdefault("lm_head.weight", sd["model.embed_tokens.weight"])  # a tied head
    return out


def mhe_to_llama(sd: dict, cfg: ModelConfig) -> dict:
    """An ``mhe`` Llama-style state dict under Hugging Face's names (the same map, inverted)."""
    return _renamed(sd, {ours: theirs for theirs, ours in _names(cfg).items()})
