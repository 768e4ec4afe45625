"""GPT-2-style multi-query decoders as Hugging Face ``GPTBigCodeForCausalLM``, exactly.

transformers' GPTBigCode (``modeling_gpt_bigcode.py``, ``multi_query=True``) is GPT-2 with one
key/value head: learned positions, pre-LN LayerNorm, a biased feed-forward, and per layer one
``nn.Linear`` ``c_attn`` whose output rows are the n*d query rows, then the d key rows, then
the d value rows. An ``mqa`` GPT-2-style decoder maps onto it by renaming and stacking; a fast
MHE one first folds into its multi-query form (:func:`mhe.attention.folding.fold_mhe`: MHE-Mul's
per-head query scales (1+eQ_i)(1+eK_i) go into the query rows and its value scales (1+eV_i)
into the output columns; MHE-Add's offsets become the query bias and the output bias W^O eV),
the identities of the paper's section 3 written into weights. The folded model equals the
mhe model in eval mode (MHE-Add's value offsets average out only without attention dropout).
GPTBigCode always has biases; a model without them gets zero ones.

===================================  ======================================================
``mhe``                              GPTBigCode
===================================  ======================================================
``decoder.embed.tokens``             ``transformer.wte``
``decoder.embed.positions``          ``transformer.wpe``
``layers.i.self_norm``, ``ffn_norm``  ``transformer.h.i.ln_1``, ``ln_2``
``self_attn.q_proj|k_proj|v_proj``   ``transformer.h.i.attn.c_attn`` (rows stacked)
``self_attn.out_proj``               ``transformer.h.i.attn.c_proj``
``ffn.fc_in``, ``ffn.fc_out``        ``transformer.h.i.mlp.c_fc``, ``mlp.c_proj``
``decoder.final_norm``, ``lm_head``  ``transformer.ln_f``, ``lm_head``
===================================  ======================================================
"""

from __future__ import annotations

import torch

from mhe.attention.folding import fold_mhe
from mhe.errors import MheError
from mhe.models import ModelConfig

BIGCODE_KINDS = ("mqa", "mhe-mul", "mhe-add")
ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}


def check_bigcode_exportable(cfg: ModelConfig) -> None:
    """The model is a GPT-2-style multi-query (or foldable MHE) language model (else one line
    naming the setting)."""
    want = {"arch": "decoder", "head": "lm", "positions": "learned", "norm": "layernorm", "mlp": "plain",
            "norm_first": True, "adaptive_cutoffs": []}
    for key, value in want.items():
        if getattr(cfg, key) != value:
            raise MheError(f"only GPT-2-style decoders export to GPTBigCode: model.{key} is {getattr(cfg, key)!r}, "
                           f"needs {value!r}")
    if cfg.attention not in BIGCODE_KINDS:
        raise MheError(f"GPTBigCode holds {', '.join(BIGCODE_KINDS)} attention, got {cfg.attention!r}")
    if cfg.resolved_head_dim * cfg.n_heads != cfg.d_model:
        raise MheError(f"GPTBigCode needs n_heads * head_dim = d_model, got {cfg.n_heads} * {cfg.resolved_head_dim} "
                       f"!= {cfg.d_model}")


def bigcode_config(cfg: ModelConfig):
    """The ``GPTBigCodeConfig`` (``multi_query=True``) of an exportable ``cfg``."""
    import transformers

    check_bigcode_exportable(cfg)
    return transformers.GPTBigCodeConfig(
        vocab_size=cfg.vocab_size, n_positions=cfg.max_len, n_embd=cfg.d_model, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, n_inner=cfg.d_ff, activation_function=ACTIVATIONS[cfg.activation],
        resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attn_dropout,
        layer_norm_epsilon=cfg.layer_norm_eps, multi_query=True, tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=None, eos_token_id=None, pad_token_id=cfg.pad_id)


def _bias(linear, size: int, like: torch.Tensor) -> torch.Tensor:
    return linear.bias if linear.bias is not None else like.new_zeros(size)


@torch.no_grad()
def mhe_to_bigcode(model) -> dict:
    """The GPTBigCode state dict of an exportable mhe model (MHE sublayers folded; the model
    itself is left unchanged)."""
    cfg, dec = model.cfg, model.decoder
    out = {"transformer.wte.weight": dec.embed.tokens.weight, "transformer.wpe.weight": dec.embed.positions.weight,
           "transformer.ln_f.weight": dec.final_norm.weight, "transformer.ln_f.bias": dec.final_norm.bias,
           "lm_head.weight": model.lm_head.weight}
    for i, layer in enumerate(dec.layers):
        h = f"transformer.h.{i}."
        attn = fold_mhe(layer.self_attn) if cfg.spec.folds else layer.self_attn
        q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj
        w = torch.cat([q.weight, k.weight, v.weight], 0)  # [n*d + 2d, m]
        out[h + "attn.c_attn.weight"] = w
        out[h + "attn.c_attn.bias"] = torch.cat([_bias(lin, lin.weight.shape[0], w) for lin in (q, k, v)])
        out[h + "attn.c_proj.weight"], out[h + "attn.c_proj.bias"] = o.weight, _bias(o, cfg.d_model, w)
        pairs = {"mlp.c_fc": layer.ffn.fc_in, "mlp.c_proj": layer.ffn.fc_out, "ln_1": layer.self_norm,
                 "ln_2": layer.ffn_norm}
        for name, mod in pairs.items():
            out[h + name + ".weight"], out[h + name + ".bias"] = mod.weight, mod.bias
    return out


def export_bigcode(model):
    """The ``GPTBigCodeForCausalLM`` equal to a GPT-2-style mqa, MHE-Mul or MHE-Add decoder (in
    eval mode; see the module docstring), in the model's dtype."""
    import transformers

    from mhe.hf.weights import load_exact

    hf = transformers.GPTBigCodeForCausalLM(bigcode_config(model.cfg)).to(next(model.parameters()).dtype)
    load_exact(hf, mhe_to_bigcode(model))
    return hf.train(model.training)
