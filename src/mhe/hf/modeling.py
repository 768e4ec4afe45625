"""``PreTrainedModel`` wrappers around the core modules (attribute ``mhe``), with generation
through the transformers 5.x ``Cache`` API: each attention layer stores exactly the K/V heads
its kind has (one for MHE and MQA, n for MHA)."""

from __future__ import annotations

import dataclasses

import torch
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

from mhe.attention.base import set_kernel
from mhe.hf.configuration import MheDecoderConfig, MheEncoderConfig, MheSeq2SeqConfig
from mhe.hf.generation import fast_generate
from mhe.models import (
    DecoderForCausalLM,
    DecoderForSequenceClassification,
    EncoderDecoder,
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
)
from mhe.models.blocks import init_weights
from mhe.models.losses import causal_lm_loss, token_loss

# transformers renamed the cache argument and output field from past_key_values to cache
CACHE_FIELD = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


class LayerCache:
    """One layer's view of a transformers ``Cache`` (dynamic or static) with the core cache
    interface: ``index``, ``max_len`` and ``update`` as a :class:`~mhe.attention.kv_cache.KVCache`
    for self-attention; ``k``, ``v`` and ``store`` as a :class:`~mhe.attention.kv_cache.CrossCache`
    for cross-attention. A static cache (``cache_implementation="static"``) allocates its buffers
    from the first keys it sees, so it holds the kind's real K/V head count.

    Args:
        new_tokens: the tokens of the forward it serves (a dynamic cache's length grows by them).
    """

    def __init__(self, cache, layer: int, new_tokens: int) -> None:
        self.cache, self.layer = cache, layer
        self.max_len = int(cache.get_mask_sizes(new_tokens, layer)[0])  # the positions update() returns

    def _layer(self):
        layers = getattr(self.cache, "layers", [])
        return layers[self.layer] if self.layer < len(layers) else None

    @property
    def index(self):
        """Where the new tokens go: a tensor for a static cache (so a compiled step is reused)."""
        length = getattr(self._layer(), "cumulative_length", None)
        return length.clone() if length is not None else self.cache.get_seq_length(self.layer)

    def update(self, k, v):
        return self.cache.update(k, v, self.layer)

    @property
    def k(self):  # cross-attention: the encoder's keys once stored, else None
        return self._layer().keys if self.cache.get_seq_length(self.layer) > 0 else None

    @property
    def v(self):
        return self._layer().values

    def store(self, k, v):
        return self.cache.update(k, v, self.layer)


KERNEL_OF_HF = {"eager": "eager", "sdpa": "sdpa"}
"""transformers' ``_attn_implementation`` -> our attention kernel (others run SDPA)."""


def apply_attn_implementation(core: torch.nn.Module, implementation: str | None) -> None:
    """Point every attention sublayer of ``core`` at the kernel matching ``implementation``."""
    set_kernel(core, KERNEL_OF_HF.get(implementation or "sdpa", "sdpa"))


def key_padding_mask(mask):
    """Our key-padding mask ``[B, S]`` from Hugging Face's 2D mask, or from the 4D mask
    ``[B, 1, T, S]`` that ``generate`` builds for a static cache (its last query row sees every
    real key so far; the model adds causality)."""
    if mask is None or mask.dim() == 2:
        return mask
    row = mask[:, 0, -1, :]  # [B, S]
    return row if row.dtype == torch.bool else row == 0


def _cache_arg(kwargs: dict):
    return kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)


class MhePreTrainedModel(PreTrainedModel):
    base_model_prefix = "mhe"
    supports_gradient_checkpointing = False
    _supports_cache_class = True
    _supports_sdpa = True
    _supports_static_cache = True
    _can_compile_fullgraph = True
    core_class = None
    head = ""

    def __init__(self, config, core: torch.nn.Module | None = None) -> None:
        """Wrap ``core`` (its weights kept bit for bit), or build and initialise one from ``config``."""
        super().__init__(config)
        self._given_core = core is not None
        self.mhe = core if core is not None else self.core_class(config.model_config(self.head))
        self.post_init()
        self._kernel_for = None
        self._sync_kernel()

    def init_weights(self):
        """transformers' initialise-and-tie step (``post_init``); never over a core handed over."""
        if not self._given_core:
            super().init_weights()

    def _initialize_weights(self, module, is_custom_code: bool = False):
        """transformers' per-module pass (``initialize_weights``, under its guard that skips every
        tensor ``from_pretrained`` loaded) reaches only the core, which initialises as a whole."""
        if module is self.mhe and not getattr(module, "_is_hf_initialized", False):
            self._init_weights(module)
            module._is_hf_initialized = True

    def _init_weights(self, module):
        """The core: its family's own scheme (``reset_parameters``, :func:`mhe.models.blocks.init_model`:
        BERT, GPT-2 or Transformer); a layer transformers builds (``resize_token_embeddings``): N(0, 0.02)."""
        if module is self.mhe:
            module.reset_parameters()
        elif isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            init_weights(module)

    def _sync_kernel(self) -> None:
        """Follow ``config._attn_implementation`` ("eager" or "sdpa"), which transformers may change."""
        impl = getattr(self.config, "_attn_implementation", None)
        if impl != self._kernel_for:
            apply_attn_implementation(self.mhe, impl)
            self._kernel_for = impl

    def _cache_to_fill(self, use_cache, kwargs: dict, new_cache):
        """The transformers cache this call reads and fills (the caller's, else ``new_cache()``),
        or None when ``use_cache`` (default: the config's) is off."""
        pkv = _cache_arg(kwargs)
        if not (self.config.use_cache if use_cache is None else use_cache):
            return None
        return new_cache() if pkv is None else pkv

    def get_input_embeddings(self):
        return self._embeddings().tokens

    def set_input_embeddings(self, value):
        self._embeddings().tokens = value

    def _embeddings(self):
        """The core's ``Embeddings``: the encoder's, the decoder's or the shared table's."""
        for holder in (getattr(self.mhe, "encoder", None), getattr(self.mhe, "decoder", None), self.mhe):
            if hasattr(holder, "embed"):
                return holder.embed
        raise AttributeError("no embeddings")


class MheEncoderForMaskedLM(MhePreTrainedModel):
    config_class = MheEncoderConfig
    core_class = EncoderForMaskedLM
    head = "mlm"
    _tied_weights_keys = {"mhe.decoder.weight": "mhe.encoder.embed.tokens.weight"}

    def get_output_embeddings(self):
        return self.mhe.decoder

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kwargs):
        out = self.mhe(input_ids, attention_mask, token_type_ids, labels=labels)
        return MaskedLMOutput(loss=out.loss, logits=out.logits, hidden_states=None)


class MheEncoderForSequenceClassification(MhePreTrainedModel):
    config_class = MheEncoderConfig
    core_class = EncoderForSequenceClassification
    head = "classification"

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None):
        out = self.mhe(input_ids, attention_mask, token_type_ids, labels=labels)
        return SequenceClassifierOutput(loss=out.loss, logits=out.logits)


class MheEncoderForQuestionAnswering(MhePreTrainedModel):
    config_class = MheEncoderConfig
    core_class = EncoderForQuestionAnswering
    head = "qa"

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, start_positions=None,
                end_positions=None):
        out = self.mhe(input_ids, attention_mask, token_type_ids, start_positions, end_positions)
        start, end = out.logits.unbind(-1)
        return QuestionAnsweringModelOutput(loss=out.loss, start_logits=start, end_logits=end)


class MheDecoderForSequenceClassification(MhePreTrainedModel):
    config_class = MheDecoderConfig
    core_class = DecoderForSequenceClassification
    head = "classification"

    def forward(self, input_ids=None, attention_mask=None, labels=None):
        out = self.mhe(input_ids, attention_mask, labels=labels)
        return SequenceClassifierOutput(loss=out.loss, logits=out.logits)


class MheDecoderForCausalLM(MhePreTrainedModel, GenerationMixin):
    config_class = MheDecoderConfig
    core_class = DecoderForCausalLM
    head = "lm"
    _tied_weights_keys = {"mhe.lm_head.weight": "mhe.decoder.embed.tokens.weight"}

    use_mhe_generate = True  # False: every generate call runs transformers' own loop

    def get_output_embeddings(self):
        return self.mhe.lm_head

    def generate(self, inputs=None, generation_config=None, **kwargs):
        """transformers' ``generate``. Greedy and sampled requests (no cache implementation or
        ``"static"``, left padding) run the core model's captured decode step, as
        ``model.generate`` does, and return what transformers returns; beam search, other logits
        processors, streamers and assisted decoding run transformers' loop (:mod:`mhe.hf.generation`)."""
        out = fast_generate(self, inputs, generation_config, kwargs)
        return out if out is not None else super().generate(inputs, generation_config, **kwargs)

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, position_ids=None,
                **kwargs):
        self._sync_kernel()
        pkv = self._cache_to_fill(use_cache, kwargs, DynamicCache)
        n = self.config.num_hidden_layers
        t = input_ids.shape[1]
        caches = None if pkv is None else [LayerCache(pkv, i, t) for i in range(n)]
        out = self.mhe(input_ids, key_padding_mask(attention_mask), caches=caches, position_ids=position_ids)
        items = kwargs.get("num_items_in_batch")  # HF Trainer: average over tokens across accumulation
        loss = None if labels is None else causal_lm_loss(out.logits, labels, num_items=items)
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, **{CACHE_FIELD: pkv})


class _EncoderShim(torch.nn.Module):
    """What ``generate`` calls as ``get_encoder()``: the core encoder, returning BaseModelOutput."""

    def __init__(self, core: EncoderDecoder) -> None:
        super().__init__()
        self.core = core

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        return BaseModelOutput(last_hidden_state=self.core.encode(input_ids, attention_mask))


class MheSeq2SeqLM(MhePreTrainedModel, GenerationMixin):
    config_class = MheSeq2SeqConfig
    core_class = EncoderDecoder
    head = "seq2seq"
    _tied_weights_keys = {"mhe.lm_head.weight": "mhe.embed.tokens.weight"}

    def get_output_embeddings(self):
        return self.mhe.lm_head

    def get_encoder(self):
        return _EncoderShim(self.mhe)

    def forward(self, input_ids=None, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                encoder_outputs=None, labels=None, use_cache=None, **kwargs):
        pkv = self._cache_to_fill(use_cache, kwargs, lambda: EncoderDecoderCache(DynamicCache(), DynamicCache()))
        core = self.mhe
        if encoder_outputs is None:
            memory = core.encode(input_ids, attention_mask)
        else:
            memory = encoder_outputs[0] if isinstance(encoder_outputs, (tuple, list)) else encoder_outputs.last_hidden_state
        if decoder_input_ids is None and labels is not None:  # teacher forcing from the labels
            start = torch.full_like(labels[:, :1], self.config.decoder_start_token_id or 0)
            decoder_input_ids = torch.cat([start, labels[:, :-1].clamp_min(0)], 1)
        caches = None
        if pkv is not None:
            t, s = decoder_input_ids.shape[1], memory.shape[1]
            caches = [(LayerCache(pkv.self_attention_cache, i, t), LayerCache(pkv.cross_attention_cache, i, s))
                      for i in range(self.config.num_hidden_layers)]
        logits = core.decode(decoder_input_ids, memory, attention_mask, decoder_attention_mask, caches=caches)
        loss = None if labels is None else token_loss(logits, labels)
        return Seq2SeqLMOutput(loss=loss, logits=logits, encoder_last_hidden_state=memory,
                               **{CACHE_FIELD: pkv})
