"""Hugging Face GPT-2, BERT, Llama, Qwen2 and Mistral weights into ``mhe`` models and back, exactly.

:func:`import_hf` takes a ``transformers`` model object, or a local directory written by
``save_pretrained``, and returns the ``mhe`` model with the same function (same logits):

==========================================  =============================================
Hugging Face class                          ``mhe`` model
==========================================  =============================================
``GPT2LMHeadModel``                         decoder, head ``lm``
``BertForMaskedLM``                         encoder, head ``mlm``
``BertForSequenceClassification``           encoder, head ``classification``
``BertForQuestionAnswering``                encoder, head ``qa``
``LlamaForCausalLM``, ``Qwen2ForCausalLM``,  Llama-style decoder (rotary positions, RMSNorm,
``MistralForCausalLM``                      SwiGLU, grouped K/V; :mod:`mhe.hf.llama`)
==========================================  =============================================

:func:`export_hf` goes back (an MHA model with attention biases and learned positions, i.e.
the ``bert-*`` and ``gpt2-*`` presets, or a Llama-style decoder with mha, gqa or mqa
attention, e.g. the ``llama-*`` presets); ``export_hf(model).save_pretrained(dir)`` writes a
checkpoint any ``transformers`` user can load. The mapping: GPT-2's ``c_attn`` (a Conv1D,
``y = x W + b`` with ``W: [m, 3m]``) holds W^Q|W^K|W^V side by side, so ``q_proj.weight`` is
``c_attn.weight[:, :m].T``; BERT's linear layers are ``nn.Linear`` like ours.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mhe.errors import MheError, name_keys, one_of
from mhe.hf.checkpoint_files import check_shapes
from mhe.hf.llama import LLAMA_CLASSES, llama_class, llama_hf_config, llama_model_config, llama_to_mhe, mhe_to_llama
from mhe.models import MODEL_CLASSES, ModelConfig

HF_ACT = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
MHE_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
HF_CLASSES = {"GPT2LMHeadModel": ("decoder", "lm"), "BertForMaskedLM": ("encoder", "mlm"),
              "BertForSequenceClassification": ("encoder", "classification"),
              "BertForQuestionAnswering": ("encoder", "qa")}
MHE_HEADS = {v: k for k, v in HF_CLASSES.items()}


def _activation(name: str) -> str:
    if name not in HF_ACT:
        raise one_of("Hugging Face activation", name, HF_ACT)
    return HF_ACT[name]


# ------------------------------------------------------------------ configurations
def gpt2_model_config(c) -> ModelConfig:
    """A ``GPT2Config`` as a :class:`ModelConfig` (pre-LN decoder with biased MHA)."""
    for flag in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if getattr(c, flag, False):
            raise MheError(f"GPT-2 option {flag}=True has no mhe equivalent")
    if not getattr(c, "scale_attn_weights", True):
        raise MheError("GPT-2 option scale_attn_weights=False has no mhe equivalent")
    return ModelConfig(arch="decoder", head="lm", vocab_size=c.vocab_size, d_model=c.n_embd, n_layers=c.n_layer,
                       n_heads=c.n_head, d_ff=c.n_inner or 4 * c.n_embd, max_len=c.n_positions, attention="mha",
                       attn_bias=True, dropout=c.resid_pdrop, attn_dropout=c.attn_pdrop, norm_first=True,
                       layer_norm_eps=c.layer_norm_epsilon, activation=_activation(c.activation_function),
                       tie_embeddings=bool(c.tie_word_embeddings), pad_id=c.pad_token_id or 0)


def bert_model_config(c, head: str) -> ModelConfig:
    """A ``BertConfig`` as a :class:`ModelConfig` (post-LN encoder with biased MHA)."""
    if getattr(c, "position_embedding_type", "absolute") != "absolute":
        raise MheError(f"BERT position_embedding_type {c.position_embedding_type!r}: only 'absolute' is supported")
    if getattr(c, "is_decoder", False):
        raise MheError("a BERT decoder (is_decoder=True) has no mhe equivalent")
    return ModelConfig(arch="encoder", head=head, vocab_size=c.vocab_size, d_model=c.hidden_size,
                       n_layers=c.num_hidden_layers, n_heads=c.num_attention_heads, d_ff=c.intermediate_size,
                       max_len=c.max_position_embeddings, attention="mha", attn_bias=True,
                       dropout=c.hidden_dropout_prob, attn_dropout=c.attention_probs_dropout_prob, norm_first=False,
                       layer_norm_eps=c.layer_norm_eps, type_vocab_size=c.type_vocab_size,
                       activation=_activation(c.hidden_act), tie_embeddings=bool(c.tie_word_embeddings),
                       pad_id=c.pad_token_id or 0, num_labels=c.num_labels if head == "classification" else 2)


def _exportable(cfg: ModelConfig) -> None:
    if (cfg.arch, cfg.head) not in MHE_HEADS:
        raise MheError(f"no Hugging Face GPT-2/BERT class for a {cfg.arch} with head {cfg.head!r}; "
                       f"exportable: {', '.join(f'{a}/{h}' for a, h in MHE_HEADS)}")
    wrong = {"attention": (cfg.attention, "mha"), "attn_bias": (cfg.attn_bias, True),
             "positions": (cfg.positions, "learned"), "head_dim": (cfg.head_dim in (None, cfg.d_model // cfg.n_heads), True),
             "norm_first": (cfg.norm_first, cfg.arch == "decoder"), "adaptive_cutoffs": (bool(cfg.adaptive_cutoffs), False)}
    if cfg.arch == "encoder":
        wrong["type_vocab_size > 0"] = (cfg.type_vocab_size > 0, True)
    for name, (have, want) in wrong.items():
        if have != want:
            raise MheError(f"only GPT-2/BERT-shaped models export to Hugging Face: model.{name} is {have!r}, needs {want!r}")


def hf_config(cfg: ModelConfig):
    """The ``GPT2Config`` or ``BertConfig`` of an exportable :class:`ModelConfig`."""
    import transformers

    _exportable(cfg)
    if cfg.arch == "decoder":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads, n_inner=cfg.d_ff,
            n_positions=cfg.max_len, resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.attn_dropout,
            layer_norm_epsilon=cfg.layer_norm_eps, activation_function=MHE_ACT[cfg.activation],
            tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=None)
    return transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.d_ff, max_position_embeddings=cfg.max_len,
        type_vocab_size=max(cfg.type_vocab_size, 1), layer_norm_eps=cfg.layer_norm_eps,
        hidden_act=MHE_ACT[cfg.activation], hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.attn_dropout, pad_token_id=cfg.pad_id,
        tie_word_embeddings=cfg.tie_embeddings, num_labels=cfg.num_labels)


# ------------------------------------------------------------------ weight names
def _gpt2_to_mhe(sd: dict, cfg: ModelConfig) -> dict:
    m = cfg.d_model
    out = {"decoder.embed.tokens.weight": sd["transformer.wte.weight"],
           "decoder.embed.positions.weight": sd["transformer.wpe.weight"],
           "decoder.final_norm.weight": sd["transformer.ln_f.weight"],
           "decoder.final_norm.bias": sd["transformer.ln_f.bias"],
           "lm_head.weight": sd.get("lm_head.weight", sd["transformer.wte.weight"])}
    for i in range(cfg.n_layers):
        h, o = f"transformer.h.{i}.", f"decoder.layers.{i}."
        w, b = sd[h + "attn.c_attn.weight"], sd[h + "attn.c_attn.bias"]  # [m, 3m], [3m]
        for j, name in enumerate(("q_proj", "k_proj", "v_proj")):
            out[o + f"self_attn.{name}.weight"] = w[:, j * m:(j + 1) * m].t()
            out[o + f"self_attn.{name}.bias"] = b[j * m:(j + 1) * m]
        pairs = {"self_attn.out_proj": "attn.c_proj", "ffn.fc_in": "mlp.c_fc", "ffn.fc_out": "mlp.c_proj"}
        for ours, theirs in pairs.items():
            out[o + ours + ".weight"] = sd[h + theirs + ".weight"].t()  # Conv1D [in, out] -> Linear [out, in]
            out[o + ours + ".bias"] = sd[h + theirs + ".bias"]
        for ours, theirs in (("self_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[o + ours + ".weight"], out[o + ours + ".bias"] = sd[h + theirs + ".weight"], sd[h + theirs + ".bias"]
    return out


def _mhe_to_gpt2(sd: dict, cfg: ModelConfig) -> dict:
    out = {"transformer.wte.weight": sd["decoder.embed.tokens.weight"],
           "transformer.wpe.weight": sd["decoder.embed.positions.weight"],
           "transformer.ln_f.weight": sd["decoder.final_norm.weight"],
           "transformer.ln_f.bias": sd["decoder.final_norm.bias"], "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.n_layers):
        h, o = f"transformer.h.{i}.", f"decoder.layers.{i}."
        out[h + "attn.c_attn.weight"] = torch.cat([sd[o + f"self_attn.{n}.weight"].t()
                                                   for n in ("q_proj", "k_proj", "v_proj")], 1)  # [m, 3m]
        out[h + "attn.c_attn.bias"] = torch.cat([sd[o + f"self_attn.{n}.bias"] for n in ("q_proj", "k_proj", "v_proj")])
        pairs = {"self_attn.out_proj": "attn.c_proj", "ffn.fc_in": "mlp.c_fc", "ffn.fc_out": "mlp.c_proj"}
        for ours, theirs in pairs.items():
            out[h + theirs + ".weight"] = sd[o + ours + ".weight"].t()
            out[h + theirs + ".bias"] = sd[o + ours + ".bias"]
        for ours, theirs in (("self_norm", "ln_1"), ("ffn_norm", "ln_2")):
            out[h + theirs + ".weight"], out[h + theirs + ".bias"] = sd[o + ours + ".weight"], sd[o + ours + ".bias"]
    return out


def _bert_names(cfg: ModelConfig) -> dict[str, str]:
    """mhe parameter name -> BERT parameter name (both ``nn.Linear``/``nn.LayerNorm``)."""
    names = {"encoder.embed.tokens": "bert.embeddings.word_embeddings",
             "encoder.embed.positions": "bert.embeddings.position_embeddings",
             "encoder.embed.types": "bert.embeddings.token_type_embeddings",
             "encoder.embed.norm": "bert.embeddings.LayerNorm"}
    for i in range(cfg.n_layers):
        o, h = f"encoder.layers.{i}.", f"bert.encoder.layer.{i}."
        names.update({o + "self_attn.q_proj": h + "attention.self.query", o + "self_attn.k_proj": h + "attention.self.key",
                      o + "self_attn.v_proj": h + "attention.self.value",
                      o + "self_attn.out_proj": h + "attention.output.dense",
                      o + "self_norm": h + "attention.output.LayerNorm", o + "ffn.fc_in": h + "intermediate.dense",
                      o + "ffn.fc_out": h + "output.dense", o + "ffn_norm": h + "output.LayerNorm"})
    head = {"mlm": {"transform.0": "cls.predictions.transform.dense", "transform.2": "cls.predictions.transform.LayerNorm",
                    "decoder": "cls.predictions.decoder"},
            "classification": {"pooler.0": "bert.pooler.dense", "classifier": "classifier"},
            "qa": {"span": "qa_outputs"}}[cfg.head]
    names.update(head)
    out = {}
    for ours, theirs in names.items():
        out[ours + ".weight"] = theirs + ".weight"
        if not ours.startswith("encoder.embed.") or ours.endswith(".norm"):
            out[ours + ".bias"] = theirs + ".bias"
    return out


def _bert_to_mhe(sd: dict, cfg: ModelConfig) -> dict:
    names = _bert_names(cfg)
    out = {ours: sd[theirs] for ours, theirs in names.items() if theirs in sd}
    if cfg.head == "mlm":
        out.setdefault("decoder.weight", sd["bert.embeddings.word_embeddings.weight"])
        out["decoder.bias"] = sd.get("cls.predictions.decoder.bias", sd.get("cls.predictions.bias"))
    return out


def _mhe_to_bert(sd: dict, cfg: ModelConfig) -> dict:
    out = {theirs: sd[ours] for ours, theirs in _bert_names(cfg).items()}
    if cfg.head == "mlm":
        out["cls.predictions.bias"] = sd["decoder.bias"]
    return out


# ------------------------------------------------------------------ entry points
def _load_hf(source, **kwargs):
    """A transformers model object as is; a directory through its saved ``architectures``."""
    if not isinstance(source, (str, Path)):
        return source
    import transformers

    path = Path(source)
    config = _hf_config(path)
    arch = (getattr(config, "architectures", None) or [""])[0]
    if arch not in HF_CLASSES and arch not in LLAMA_CLASSES:
        raise one_of(f"Hugging Face model class in {path}", arch, (*HF_CLASSES, *LLAMA_CLASSES))
    check_shapes(path, getattr(transformers, arch), config)  # whole weights of config.json's shapes, or one line
    return getattr(transformers, arch).from_pretrained(str(path), **kwargs)


def _hf_config(path: Path):
    """The directory's ``config.json`` as transformers reads it, after checking it is a JSON object
    with a ``model_type`` (else one line, not transformers' traceback)."""
    import json

    import transformers

    file = path / "config.json"
    if not file.is_file():
        raise MheError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MheError(f"{file} is not readable JSON ({e})") from None
    if not isinstance(raw, dict):
        raise MheError(f"{file}: must be a JSON object (a Hugging Face configuration), got {type(raw).__name__}")
    if not isinstance(raw.get("model_type"), str):
        raise MheError(f"{file} has no model_type: not a Hugging Face configuration (a run folder's config.json "
                       "records a run)")
    try:
        return transformers.AutoConfig.from_pretrained(str(path))
    except (ValueError, KeyError, TypeError) as e:
        raise MheError(f"{file}: transformers cannot read it ({str(e).splitlines()[0]})") from None


def import_hf(source, **from_pretrained_kwargs):
    """The ``mhe`` model equal to a Hugging Face GPT-2, BERT, Llama, Qwen2 or Mistral model.

    Args:
        source: a ``GPT2LMHeadModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``,
            ``BertForQuestionAnswering``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
            ``MistralForCausalLM`` object, or a local directory one was saved to.
        **from_pretrained_kwargs: passed to ``from_pretrained`` for a directory (e.g. ``dtype``).

    Returns:
        The ``mhe`` model (MHA with biases; for the Llama family its K/V grouping and biases),
        in the source's dtype, in eval mode if the source was. It keeps the weights bit for bit:
        every tensor is the source's (GPT-2's fused, transposed ones split and transposed), and
        the source is left unchanged.
    """
    hf = _load_hf(source, **from_pretrained_kwargs)
    name = type(hf).__name__
    sd = hf.state_dict()
    if name in LLAMA_CLASSES:
        arch, head = "decoder", "lm"
        cfg = llama_model_config(hf.config, name)
        state = llama_to_mhe(sd, cfg)
    elif name in HF_CLASSES:
        arch, head = HF_CLASSES[name]
        cfg = gpt2_model_config(hf.config) if arch == "decoder" else bert_model_config(hf.config, head)
        state = _gpt2_to_mhe(sd, cfg) if arch == "decoder" else _bert_to_mhe(sd, cfg)
    else:
        raise one_of("Hugging Face model class", name, (*HF_CLASSES, *LLAMA_CLASSES))
    dtype = next(hf.parameters()).dtype
    model = MODEL_CLASSES[(arch, head)](cfg).to(dtype)
    load_exact(model, state)
    return model.train(hf.training)


def export_hf(model, family: str | None = None, *, tokenizer=None):
    """The Hugging Face model equal to an ``mhe`` model: ``GPT2LMHeadModel`` or ``BertFor*`` for
    MHA with attention biases and learned positions (the gpt2-*/bert-* presets);
    ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``MistralForCausalLM`` (``family``: ``llama``,
    ``qwen2``, ``mistral``; default Qwen2 for Q/K/V biases alone, else Llama) for a Llama-style
    decoder with mha, gqa or mqa attention. Keeps the weights bit for bit: every parameter of
    the new model is copied from ``model`` (its own initialisation is overwritten; a parameter
    left without a source is an error). With ``tokenizer`` (a ``tokenizers.Tokenizer`` or a
    ``PreTrainedTokenizerFast``) the model's ``save_pretrained`` also writes the tokenizer, and its
    config takes the tokenizer's ``[BOS]``/``[EOS]`` ids (:func:`mhe.hf.export.with_tokenizer`)."""
    import transformers

    cfg = model.cfg
    llama = cfg.positions == "rotary"
    if family is not None and not llama:
        raise MheError(f"family={family!r} chooses among Llama-style classes (rotary positions); this {cfg.arch} "
                       "exports as GPT-2/BERT: drop family")
    name = llama_class(cfg, family) if llama else MHE_HEADS.get((cfg.arch, cfg.head))
    config = llama_hf_config(cfg, name) if llama else hf_config(cfg)
    hf = getattr(transformers, name)(config)
    dtype = next(model.parameters()).dtype
    hf = hf.to(dtype)
    sd = model.state_dict()
    if llama:
        state = mhe_to_llama(sd, cfg)
    else:
        state = _mhe_to_gpt2(sd, cfg) if cfg.arch == "decoder" else _mhe_to_bert(sd, cfg)
    load_exact(hf, state)
    hf = hf.train(model.training)
    if tokenizer is None:
        return hf
    from mhe.hf.export import with_tokenizer

    return with_tokenizer(hf, tokenizer)


def load_exact(target: torch.nn.Module, state: dict) -> None:
    """Copy every parameter; a parameter of ``target`` left without a value, or a value of
    ``state`` no parameter takes, is an error naming up to five keys."""
    own = dict(target.named_parameters(remove_duplicate=False))
    missing = [k for k in own if k not in state]
    if missing:
        raise MheError(f"no source weight for {name_keys(missing)}")
    unused = [k for k in state if k not in own]
    if unused:
        raise MheError(f"source weights no parameter takes: {name_keys(unused)}")
    with torch.no_grad():
        for k, p in own.items():
            src = state[k]
            if tuple(src.shape) != tuple(p.shape):
                raise MheError(f"weight {k}: shape {tuple(src.shape)} does not fit {tuple(p.shape)}")
            p.copy_(src)
