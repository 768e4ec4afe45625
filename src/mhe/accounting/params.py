"""Parameter counts of attention sublayers: analytic formulas and measured counts.

Conventions (docs/paper-notes.md, derived from the paper's tables): projection
weights only unless ``bias=True``; Tables 1-3 and Appendix C include the output
projection, Table 4, Figures 1/3/4 and the GPT-3 projection (section 5.4) do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mhe.attention.options import AttentionConfig
from mhe.attention.spec import AttentionSpec, attention_spec, make_config
from mhe.errors import MheError, one_of
from mhe.models.config import ARCHS, ModelConfig

if TYPE_CHECKING:  # the formulas need no torch (``mhe params`` starts without it); the counts of built models do
    from torch import nn


def attention_params(kind: str | AttentionSpec, *, d_model: int, n_heads: int, head_dim: int | None = None,
                     include_output: bool = True, bias: bool = False, **options) -> int:
    """Analytic parameter count of one attention sublayer.

    With m = d_model, n = n_heads, d = head_dim (Table 4 has m = n*d):

    ========  ======================  =============
    kind      Q, K, V                 extra
    ========  ======================  =============
    mha       3 m n d
    gqa       m n d + 2 m g d         g = n_kv_heads
    mqa       m n d + 2 m d
    skv       2 m n d
    el-att    m n d
    sha       3 m d
    mhe-*     3 m d                   + 3 n d head embeddings
    fnet      0
    linear    max_len^2 + m^2         (no output projection)
    ========  ======================  =============

    plus n d m for the output projection when ``include_output`` (not for fnet
    and linear, which have none), plus every bias when ``bias`` (the Q/K/V ones alone with the
    option ``qkv_bias=True``, as Qwen2 has them).
    """
    spec = attention_spec(kind)  # ``kind``: its spec, or its name (looked up once here)
    cfg = make_config(spec, d_model=d_model, n_heads=n_heads, head_dim=head_dim, bias=bias, **options)
    return spec.params(cfg, include_output=include_output)


def sublayer_params(kind: str | AttentionSpec, cfg: AttentionConfig, *, include_output: bool = True) -> int:
    """:func:`attention_params` of a sublayer's typed configuration (a model's:
    :meth:`~mhe.models.ModelConfig.attention_config`); the formula is the kind's spec's
    (:meth:`~mhe.attention.spec.AttentionSpec.params`)."""
    return attention_spec(kind).params(cfg, include_output=include_output)


def count_params(module: nn.Module, *, include_output: bool = True, include_bias: bool = True) -> int:
    """Measured count: every parameter the module holds (``out_proj`` and the projection
    biases left out on request)."""
    return sum(p.numel() for name, p in module.named_parameters()
               if (include_output or "out_proj" not in name.split("."))
               and (include_bias or name.split(".")[-1] != "bias"))


def attention_sublayers(arch: str, n_layers: int) -> int:
    """Attention sublayers in a model: L (encoder or decoder) or 3L (encoder-decoder:
    L encoder self-, L decoder self- and L decoder cross-attention; paper-notes)."""
    if arch not in ARCHS:
        raise one_of("architecture", arch, ARCHS)
    return 3 * n_layers if arch == "encoder-decoder" else n_layers


def model_attention_params(kind: str | AttentionSpec, *, arch: str, n_layers: int, d_model: int, n_heads: int,
                           head_dim: int | None = None, include_output: bool = True,
                           bias: bool = False, **options) -> int:
    """Analytic attention parameters of a whole model (every sublayer of one kind)."""
    per = attention_params(kind, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                           include_output=include_output, bias=bias, **options)
    return per * attention_sublayers(arch, n_layers)


def count_attention_params(model: nn.Module, *, include_output: bool = True, include_bias: bool = False) -> int:
    """Measured attention parameters of a model: the sum over its attention modules.

    By default in the paper's convention (section 5.3, Table 4): projection weights (and MHE
    head embeddings), no biases, even where the model has them (the BERT and GPT-2 presets);
    ``include_bias=True`` counts everything the modules hold."""
    from mhe.attention.base import Attention

    return sum(count_params(mod, include_output=include_output, include_bias=include_bias)
               for mod in model.modules() if isinstance(mod, Attention))


def model_param_counts(model: nn.Module) -> dict[str, int]:
    """What a model holds, each count saying what it includes: ``total`` (every distinct
    parameter: embeddings, biases, LayerNorms, heads; tied weights once), ``attention``
    (the paper's convention: attention weights without biases) and ``attention_bias``."""
    with_bias = count_attention_params(model, include_bias=True)
    weights = count_attention_params(model)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    return {"total": total, "attention": weights, "attention_bias": with_bias - weights}


def gpt3_projection(kinds=("mha", "el-att", "mqa", "skv", "mhe-add", "mhe-mul", "sha")) -> dict[str, int]:
    """Section 5.4: attention parameters of GPT-3 (96 layers, 96 heads of 128), no output projection."""
    return {k: model_attention_params(k, arch="decoder", n_layers=96, d_model=96 * 128, n_heads=96,
                                      include_output=False) for k in kinds}


def decoder_params(cfg: ModelConfig) -> dict[str, int]:
    """Every parameter a decoder language model of ``cfg`` holds, analytically, by part:

    * ``embeddings``: token embeddings V m, plus learned positions max_len m;
    * ``attention``: L sublayers as :func:`attention_params` counts them, with the biases the
      model has (``attn_bias``: every projection; ``qkv_bias``: Q/K/V) and grouped K/V heads;
    * ``feed_forward``: per layer 2 m d_ff + d_ff + m (plain, with biases) or 3 m d_ff
      (SwiGLU: gate, up and down, no biases); 0 without one (``mlp="none"``);
    * ``norms``: 2L + 1 normalisations (L + 1 without feed-forward sublayers) of 2m (LayerNorm)
      or m (RMSNorm) each;
    * ``head``: the output projection V m when untied, 0 when tied to the embeddings;
    * ``total``: the sum, equal to counting the built model (tied weights once).
    """
    if cfg.arch != "decoder" or cfg.head != "lm" or cfg.adaptive_cutoffs:
        raise MheError(f"decoder_params counts decoder language models with a linear output layer, "
                       f"got arch={cfg.arch!r}, head={cfg.head!r}" + (", adaptive softmax" if cfg.adaptive_cutoffs else ""))
    m, L = cfg.d_model, cfg.n_layers
    attn = sublayer_params(cfg.spec, cfg.attention_config(causal=True))  # its grouping, biases, ...
    ffn = {"swiglu": 3 * m * cfg.d_ff, "none": 0}.get(cfg.mlp, 2 * m * cfg.d_ff + cfg.d_ff + m)
    norm = m if cfg.norm == "rmsnorm" else 2 * m
    n_norms = (L if cfg.mlp == "none" else 2 * L) + 1
    parts = {"embeddings": cfg.vocab_size * m + (cfg.max_len * m if cfg.positions == "learned" else 0),
             "attention": L * attn, "feed_forward": L * ffn, "norms": n_norms * norm,
             "head": 0 if cfg.tie_embeddings else cfg.vocab_size * m}
    parts["total"] = sum(parts.values())
    return parts
