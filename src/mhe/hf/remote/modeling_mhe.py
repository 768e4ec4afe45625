"""The models of an exported mhe run, in plain torch and transformers (no mhe needed).

Multi-head embedding attention (MHE; Xue & Aletras, "Pit One Against Many", Findings of
EMNLP 2023, section 3) and the kinds it is compared with, in the three architectures the
paper trains: a BERT-like encoder, a GPT-2-like or Llama-style decoder, and the Transformer
encoder-decoder. The module and parameter names are mhe's own, so an mhe state dict loads
here unchanged (``model.safetensors`` of the exported folder).

Attention kinds (``config.mhe["attention"]``), all through one :class:`Attention`:

* ``mha``, ``mqa``, ``gqa``: n query heads over g key/value heads (g = n, 1, ``n_kv_heads``);
* ``skv``: keys equal values, one projection; ``el-att``: the input's head slices are the
  keys and values; ``sha``: one head, its output tiled n times before the output projection;
* ``mhe-mul`` / ``mhe-add``: one seed projection per role (W^Q, W^K, W^V: m x d) and head
  embeddings ``head_embed[3, n, d]`` (q, k, v); head i uses psi(A, e_i) = A * (1 + e_i) (Mul)
  or A + e_i (Add) (paper Eqs. 4-6). Computed with one shared K/V head (the identities of the
  paper's section 3: the key factors move onto the queries, the value factors after the
  attention average), so the KV cache holds one head. Under rotary positions,
  ``rope_order="rope-then-psi"`` embeds after the rotation (still one shared head) and
  ``"psi-then-rope"`` before it (n explicit heads, n cached).
* ``fnet`` and ``linear`` mix whole sequences (Lee-Thorp et al. 2022): no cache.

Inference runs MHE at multi-query cost, as mhe's own inference view does: in eval mode without
gradients an MHE sublayer keeps its per-head query factors and its folded output weight and bias
(MHE-Mul: W^O's columns scaled by 1 + e^V; MHE-Add: the bias b^O + W^O e^V) as buffers outside the
state dict, made at its first such call and again when the weights they come from change (a
version counter or storage moves; ``eval()``; ``out_proj`` replaced, as peft does) - a write through
``.data`` alone is not seen until then; training and calls that want gradients compute from the
weights. The cache holds one K/V head a layer (``num_key_value_heads``, transformers' dynamic and
static caches), and SDPA reads it as it is: one new token's n query heads become rows of one query,
a prompt goes through ``enable_gqa`` (``generate`` hands it the 2D mask: causal kernels); a decode step
under a mask on a card runs FlashAttention-2's split-KV forward (``decode_mhe.py``). The RoPE table
is made once on the CPU (mhe's constants) and indexed once a forward; ``generate``'s static cache compiles (``torch.compile``, one graph).

LoRA (peft): every projection is an ``nn.Linear`` called as a module, so adapters apply
wherever they are put. Attention: ``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` (``kv_proj``
for skv); feed-forward: ``fc_in``, ``fc_out`` (GPT-2, BERT, Transformer) or ``gate``, ``up``,
``down`` (Llama-style). MHE's head embeddings are parameters, not layers: train them with
``modules_to_save`` or leave them frozen.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.modeling_outputs import (
    BaseModelOutput,
    CausalLMOutputWithPast,
    MaskedLMOutput,
    QuestionAnsweringModelOutput,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
)

from .configuration_mhe import MheConfig
from .layers_mhe import (Attention, Block, Decoder, Embeddings, Encoder, Mixing, RMSNorm, _cache_arg, activation,
                         key_padding, padding_mask, self_attention_mask)

# transformers renamed the cache argument and output field from past_key_values to cache
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


# ------------------------------------------------------------------ transformers models
class MhePreTrainedModel(PreTrainedModel):
    config_class = MheConfig
    base_model_prefix = "mhe"
    supports_gradient_checkpointing = False
    _supports_sdpa = True
    _supports_cache_class = True
    _supports_static_cache = True

    def _init_weights(self, module):
        """For a model built from its configuration: N(0, 0.02) weights and head embeddings,
        zero biases, unit norms (a trained checkpoint overwrites every weight)."""
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            nn.init.ones_(module.weight)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, Attention) and hasattr(module, "head_embed"):
            nn.init.normal_(module.head_embed, std=0.02)
        elif isinstance(module, Mixing) and hasattr(module, "seq_mix"):
            nn.init.normal_(module.seq_mix, std=module.seq_mix.shape[0] ** -0.5)

    def _logits(self, head, h):
        return head(h)[..., :self.config.vocab_size]


def _token_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)


class MheForCausalLM(MhePreTrainedModel, GenerationMixin):
    """The decoder with its language-model head (tied to the token embeddings when the config says)."""

    _tied_weights_keys = {"lm_head.weight": "decoder.embed.tokens.weight"}
    _can_compile_fullgraph = True  # one graph a decode step (tests/hf/test_hf_remote_fast.py)

    def __init__(self, config: MheConfig) -> None:
        super().__init__(config)
        s = config.mhe
        self.decoder = Decoder(s)
        self.lm_head = nn.Linear(s["d_model"], s["vocab_size"], bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.decoder.embed.tokens

    def set_input_embeddings(self, value):
        self.decoder.embed.tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def create_masks_for_generate(self, **kwargs):
        """The mask ``generate`` hands a compilable (static) cache's forward: a prompt's 2D mask as
        it is, so that the prompt (run eagerly) takes SDPA's causal kernels over the one K/V head
        where nothing is padded, instead of a dense ``[B, 1, T, L]`` mask over K/V repeated to every
        head; for a decode step transformers' own 4D mask (its fixed shape keeps the compiled step one
        graph, and ``decode_mhe`` reads each row's run of keys from it)."""
        from transformers.masking_utils import create_masks_for_generate

        embeds = kwargs.get("inputs_embeds")
        if embeds is not None and embeds.shape[1] > 1:
            return kwargs.get("attention_mask")
        return create_masks_for_generate(**kwargs)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        """``logits_to_keep``: the last that many positions' logits (0: all), or the positions to keep
        (as transformers' Llama takes it: ``generate`` asks for the prompt's last one only)."""
        cache = _cache_arg(kwargs)
        if not (self.config.use_cache if use_cache is None else use_cache):
            cache = None
        elif cache is None:
            cache = DynamicCache()
        h = self.decoder(input_ids, attention_mask, cache, position_ids)
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self._logits(self.lm_head, h[:, keep])
        loss = None if labels is None else _token_loss(logits[:, :-1], labels[:, 1:])
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_FIELD: cache})


class MheDecoderForSequenceClassification(MhePreTrainedModel):
    """The decoder classifying from its last non-padding token (right padding)."""

    def __init__(self, config: MheConfig) -> None:
        super().__init__(config)
        s = config.mhe
        self.decoder = Decoder(s)
        self.drop = nn.Dropout(s.get("dropout", 0.0))
        self.classifier = nn.Linear(s["d_model"], config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        h = self.decoder(input_ids, attention_mask)
        last = (attention_mask.long().sum(1) - 1 if attention_mask is not None
                else torch.full((h.shape[0],), h.shape[1] - 1, device=h.device))
        logits = self.classifier(self.drop(h[torch.arange(h.shape[0], device=h.device), last]))
        return SequenceClassifierOutput(loss=_classification_loss(logits, labels), logits=logits)


def _classification_loss(logits, labels):
    if labels is None:
        return None
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.squeeze(-1).float(), labels.float())
    return F.cross_entropy(logits.float(), labels)


class MheForMaskedLM(MhePreTrainedModel):
    """The encoder with BERT's masked-LM head (dense, activation, LayerNorm, tied decoder)."""

    _tied_weights_keys = {"decoder.weight": "encoder.embed.tokens.weight"}

    def __init__(self, config: MheConfig) -> None:
        super().__init__(config)
        s = config.mhe
        m = s["d_model"]
        self.encoder = Encoder(s)
        self.transform = nn.Sequential(nn.Linear(m, m), activation(s.get("activation", "gelu")),
                                       nn.LayerNorm(m, eps=s.get("layer_norm_eps", 1e-5)))
        self.decoder = nn.Linear(m, s["vocab_size"])
        self.post_init()

    def get_input_embeddings(self):
        return self.encoder.embed.tokens

    def get_output_embeddings(self):
        return self.decoder

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        h = self.encoder(input_ids, attention_mask, token_type_ids)
        logits = self._logits(self.decoder, self.transform(h))
        return MaskedLMOutput(loss=None if labels is None else _token_loss(logits, labels), logits=logits)


class MheForSequenceClassification(MhePreTrainedModel):
    """The encoder with BERT's [CLS] pooler (dense, tanh) and a linear classifier."""

    def __init__(self, config: MheConfig) -> None:
        super().__init__(config)
        s = config.mhe
        self.encoder = Encoder(s)
        self.pooler = nn.Sequential(nn.Linear(s["d_model"], s["d_model"]), nn.Tanh())
        self.drop = nn.Dropout(s.get("dropout", 0.0))
        self.classifier = nn.Linear(s["d_model"], config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        h = self.encoder(input_ids, attention_mask, token_type_ids)
        logits = self.classifier(self.drop(self.pooler(h[:, 0])))
        return SequenceClassifierOutput(loss=_classification_loss(logits, labels), logits=logits)


class MheForQuestionAnswering(MhePreTrainedModel):
    """The encoder with a start/end span head (SQuAD)."""

    def __init__(self, config: MheConfig) -> None:
        super().__init__(config)
        self.encoder = Encoder(config.mhe)
        self.span = nn.Linear(config.mhe["d_model"], 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, **kwargs):
        start, end = self.span(self.encoder(input_ids, attention_mask, token_type_ids)).unbind(-1)
        return QuestionAnsweringModelOutput(start_logits=start, end_logits=end)


class _EncoderView(nn.Module):
    """What ``generate`` calls as ``get_encoder()``: the encoder half, returning BaseModelOutput."""

    main_input_name = "input_ids"

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return BaseModelOutput(last_hidden_state=self.model.encode(input_ids, attention_mask))


class MheForSeq2SeqLM(MhePreTrainedModel, GenerationMixin):
    """The Transformer encoder-decoder: one embedding table for source and target, tied to the
    output layer; the decoder's cross-attention reads the encoder's output (its keys and values
    are recomputed each step; the self-attention K/V go through the cache)."""

    _tied_weights_keys = {"lm_head.weight": "embed.tokens.weight"}

    def __init__(self, config: MheConfig) -> None:
        super().__init__(config)
        s = config.mhe
        self.embed = Embeddings(s, norm=False)
        self.encoder_layers = nn.ModuleList(Block(s, causal=False, cross=False) for _ in range(s["n_layers"]))
        self.decoder_layers = nn.ModuleList(Block(s, causal=True, cross=True) for _ in range(s["n_layers"]))
        first, eps = bool(s.get("norm_first", False)), s.get("layer_norm_eps", 1e-5)
        self.encoder_norm = nn.LayerNorm(s["d_model"], eps=eps) if first else None
        self.decoder_norm = nn.LayerNorm(s["d_model"], eps=eps) if first else None
        self.lm_head = nn.Linear(s["d_model"], s["vocab_size"], bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed.tokens

    def get_output_embeddings(self):
        return self.lm_head

    def get_encoder(self):
        return _EncoderView(self)

    def encode(self, input_ids, attention_mask=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids, positions)
        mask, padding = padding_mask(attention_mask), key_padding(attention_mask)
        for layer in self.encoder_layers:
            x = layer(x, mask=mask, padding=padding)
        return self.encoder_norm(x) if self.encoder_norm is not None else x

    def decode(self, ids, memory, attention_mask=None, decoder_attention_mask=None, cache=None):
        t = ids.shape[1]
        start = cache.get_seq_length() if cache is not None else 0
        positions = start + torch.arange(t, device=ids.device)
        x = self.embed(ids, positions)
        mask = self_attention_mask(decoder_attention_mask, t, start, True, ids.device)
        cross = padding_mask(attention_mask)
        for i, layer in enumerate(self.decoder_layers):
            x = layer(x, mask=mask, cache=cache, layer=i, context=memory, context_mask=cross)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self._logits(self.lm_head, x)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, labels=None, use_cache=None, **kwargs):
        cache = _cache_arg(kwargs)
        if encoder_outputs is None:
            memory = self.encode(input_ids, attention_mask)
        else:
            memory = encoder_outputs[0] if isinstance(encoder_outputs, (tuple, list)) \
                else encoder_outputs.last_hidden_state
        if decoder_input_ids is None and labels is not None:  # teacher forcing from the labels
            start = torch.full_like(labels[:, :1], self.config.decoder_start_token_id or 0)
            decoder_input_ids = torch.cat([start, labels[:, :-1].clamp_min(0)], 1)
        if not (self.config.use_cache if use_cache is None else use_cache):
            cache = None
        elif cache is None:
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        own = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        logits = self.decode(decoder_input_ids, memory, attention_mask, decoder_attention_mask, own)
        loss = None if labels is None else _token_loss(logits, labels)
        return Seq2SeqLMOutput(loss=loss, logits=logits, encoder_last_hidden_state=memory, **{CACHE_FIELD: cache})


CLASSES = {("decoder", "lm"): MheForCausalLM, ("decoder", "classification"): MheDecoderForSequenceClassification,
           ("encoder", "mlm"): MheForMaskedLM, ("encoder", "classification"): MheForSequenceClassification,
           ("encoder", "qa"): MheForQuestionAnswering, ("encoder-decoder", "seq2seq"): MheForSeq2SeqLM}
"""(architecture, head) -> the class that holds it."""
