"""Decoder-only transformer (GPT-2, paper section 4.3) with a KV cache for generation."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mhe.attention import masks
from mhe.attention.kernels import DecodePlan
from mhe.attention.kv_cache import KVCache, check_layer_caches, layer_caches
from mhe.attention.rotary import RotaryEmbedding
from mhe.attention.masks import AttentionMask
from mhe.models.blocks import Block, Embeddings, init_model
from mhe.errors import MheError
from mhe.models.config import ModelConfig
from mhe.models.inputs import check_labels, check_mask
from mhe.models.layers import build_norm
from mhe.models.losses import IGNORE, causal_lm_loss, chunked_loss_wanted, classification_loss, head_loss
from mhe.models.outputs import ModelOutput, as_bool_mask

if TYPE_CHECKING:
    from mhe.generation.session import Generator


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


class Decoder(nn.Module):
    """Pre-LN decoder stack: causal self-attention, final normalisation. GPT-2 (learned positions,
    LayerNorm, GELU feed-forward) or Llama-style (rotary positions, RMSNorm, SwiGLU), as ``cfg``
    says (:class:`~mhe.models.config.ModelConfig`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = Embeddings(cfg, norm=False)
        self.layers = nn.ModuleList(Block(cfg, causal=True, cross=False) for _ in range(cfg.n_layers))
        self.final_norm = build_norm(cfg)
        self.rotary = None
        if cfg.positions == "rotary":  # one table for every layer
            self.rotary = RotaryEmbedding(cfg.resolved_head_dim, base=cfg.rope_base, fraction=cfg.rope_fraction,
                                          max_len=cfg.max_len)
            for layer in self.layers:
                layer.self_attn.attach_rotary(self.rotary)

    def forward(self, input_ids, attention_mask=None, caches: list[KVCache] | None = None,
                position_ids: torch.Tensor | None = None, plan: DecodePlan | None = None):
        """Hidden states ``[B, T, m]`` of ``input_ids`` ``[B, T]``.

        The positions (``position_ids``, else the caches' write position onwards) and the mask
        are made once here and handed to every layer. ``attention_mask``: ``[B, T]`` (1 = real
        token); with ``caches`` ``[B, L]`` over the cache or ``[B, start + T]`` over every
        position so far; or an :class:`~mhe.attention.masks.AttentionMask` built by the caller
        (generation's prefill, beam search's window). ``plan``: a decoding run's
        :class:`~mhe.attention.kernels.DecodePlan` (the mask form built here and the kernel of
        every layer); None: the configured kernel over a dense mask.
        """
        if caches:
            check_layer_caches(caches)
        start = caches[0].index if caches else 0  # where the new tokens go in the caches
        positions = position_ids if position_ids is not None else self.embed.token_positions(input_ids, start=start)
        x = self.embed(input_ids, positions=positions)
        mask = attention_mask
        if not isinstance(mask, AttentionMask):
            check_mask("attention_mask", mask, input_ids.shape[0], None if caches else input_ids.shape[1])
            mask = masks.self_attention_mask(input_ids, as_bool_mask(mask), start=start,
                                             keys=caches[0].max_len if caches else None, plan=plan)
        for i, layer in enumerate(self.layers):
            x = layer(x, positions=positions, mask=mask, cache=caches[i] if caches else None, plan=plan)
        return self.final_norm(x)

    def new_caches(self, batch: int, max_len: int | None = None, *, dtype=None, device=None) -> list[KVCache]:
        """One preallocated cache per layer, sized for the attention kind, sharing one write
        position (:func:`~mhe.attention.kv_cache.layer_caches`)."""
        return layer_caches((layer.self_attn for layer in self.layers), batch, max_len or self.cfg.max_len,
                            dtype=dtype, device=device)


class _DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.decoder = Decoder(cfg)

    def reset_parameters(self) -> None:
        """(Re)draw every weight by the family's scheme (:func:`mhe.models.blocks.init_model`); run
        when built, and by the Hugging Face adapter when it builds its own core. GPT-2's scheme;
        the Llama family's is N(0, 0.02) everywhere (transformers' LlamaPreTrainedModel,
        initializer_range 0.02), without GPT-2's residual scaling."""
        init_model(self, "bert" if self.cfg.positions == "rotary" else "gpt2", n_layers=self.cfg.n_layers)

    def new_caches(self, batch: int, max_len: int | None = None, *, dtype=None, device=None):
        return self.decoder.new_caches(batch, max_len, dtype=dtype, device=device)


class DecoderForCausalLM(_DecoderModel):
    """GPT-2 language model with the output projection tied to the token embeddings.

    With ``cfg.adaptive_cutoffs`` the output layer is instead an adaptive softmax
    (Grave et al. 2017; ``torch.nn.AdaptiveLogSoftmaxWithLoss``, untied): frequent words get
    the full width, rare ones narrower clusters, which makes large word-level vocabularies
    affordable on a CPU. ``logits`` are then exact log-probabilities.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.lm_head, self.adaptive = None, None
        if cfg.adaptive_cutoffs:
            self.adaptive = nn.AdaptiveLogSoftmaxWithLoss(cfg.d_model, cfg.vocab_size, list(cfg.adaptive_cutoffs),
                                                          div_value=4.0)
        else:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings and self.lm_head is not None:
            self.lm_head.weight = self.decoder.embed.tokens.weight
        # the matrices with a row per token (mhe.models.vocab_padding); none beside an adaptive softmax
        self.vocab_modules = ("decoder.embed.tokens", "lm_head") if self.lm_head is not None else ()

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)[..., :self.cfg.vocab_size]  # [B, T, V]: padding rows never score

    def forward(self, input_ids, attention_mask=None, labels=None, caches=None, return_logits=True,
                position_ids=None, last_only=False, chunked_loss=None, score_at=None,
                plan: DecodePlan | None = None):
        """``labels`` are the inputs themselves: position t is scored on token t+1;
        -100 marks positions to ignore. ``return_logits=False`` skips the full output
        distribution where only the loss is needed (adaptive softmax; the full softmax below
        float32 scores chunk by chunk, :func:`~mhe.models.losses.head_loss`, and ``logits`` is
        None; ``chunked_loss`` True or False chooses, :func:`~mhe.models.losses.chunked_loss_wanted`);
        ``last_only`` computes the logits of the last position only (``[B, 1, V]``), ``score_at``
        (``[B, K]`` positions, without labels) those of K positions per row (``[B, K, V]``): a task
        that scores a few positions of each row (recall) skips the output layer elsewhere; ``plan``:
        a decoding run's :class:`~mhe.attention.kernels.DecodePlan` (:meth:`Decoder.forward`)."""
        h = self.decoder(input_ids, attention_mask, caches, position_ids, plan)
        check_labels("labels", labels, input_ids.shape)
        if last_only and labels is None:
            h = h[:, -1:]
        if score_at is not None:
            if labels is not None or last_only:
                raise MheError("score_at chooses the positions to score; give it without labels and last_only")
            h = h.gather(1, score_at[..., None].expand(-1, -1, h.shape[-1]))
        if self.adaptive is None:
            if labels is not None and not return_logits and chunked_loss_wanted(h, self.lm_head.weight, chunked_loss):
                return ModelOutput(None, head_loss(self.lm_head, h[:, :-1], labels[:, 1:],
                                                   vocab_size=self.cfg.vocab_size), h)
            logits = self._logits(h)  # [B, T, V]
            loss = None if labels is None else causal_lm_loss(logits, labels)
            return ModelOutput(logits, loss, h)
        loss = None
        if labels is not None:
            target = labels[:, 1:]
            keep = target != IGNORE
            loss = self.adaptive(_at_least_fp32(h[:, :-1][keep]), target[keep]).loss
        logits = None
        if return_logits or labels is None:
            logits = self.adaptive.log_prob(_at_least_fp32(h.flatten(0, 1))).view(*h.shape[:2], -1)  # [B, T, V]
        return ModelOutput(logits, loss, h)

    def target_log_probs(self, input_ids: torch.Tensor, first: int = 0) -> torch.Tensor:
        """log p(x[t+1] | x[..t]) for t = first .. T-2, ``[B, T-1-first]``, computing the output
        layer only where it is needed (for perplexity)."""
        h = self.decoder(input_ids)[:, first:-1]
        target = input_ids[:, first + 1:]
        if self.adaptive is not None:
            return self.adaptive(_at_least_fp32(h.flatten(0, 1)), target.flatten()).output.view(target.shape)
        return F.log_softmax(_at_least_fp32(self._logits(h)), -1).gather(-1, target[..., None]).squeeze(-1)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, *, eos_id: int | None = None, **options):
        """Continue ``input_ids`` (see :func:`mhe.generation.session.generate` for the options:
        sampling, stop tokens, left-padded batches, streaming, a reusable ``session``, compiled
        decode steps); ``eos_id`` adds a stop token."""
        from mhe.generation.session import generate  # decoding code loads when first used, not with the model

        stop = options.pop("stop_ids", ())
        stop = tuple(stop) + ((eos_id,) if eos_id is not None else ())
        return generate(self, input_ids, max_new_tokens, stop_ids=stop, **options)

    def generator(self, batch: int, max_len: int, **options):
        """The caches and decode step for ``batch`` prompts of up to ``max_len`` positions (prompt +
        new tokens), for the caller to hold and pass as ``generate(..., session=...)``; options:
        ``step_mode``, ``kernel``, ``compile_options`` (:class:`~mhe.generation.session.Generator`)."""
        from mhe.generation.session import Generator

        return Generator(self, batch, max_len, **options)


class DecoderForSequenceClassification(_DecoderModel):
    """Classifies from the hidden state of the last non-padding token (paper-notes)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.classifier = nn.Linear(cfg.d_model, cfg.num_labels)
        self.reset_parameters()

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.decoder(input_ids, attention_mask)
        if attention_mask is None:
            last = torch.full((h.shape[0],), h.shape[1] - 1, device=h.device)
        else:
            last = as_bool_mask(attention_mask).long().sum(1) - 1  # right padding
        pooled = h[torch.arange(h.shape[0], device=h.device), last]  # [B, m]
        logits = self.classifier(self.drop(pooled))
        loss = None if labels is None else classification_loss(logits, labels, self.cfg.num_labels)
        return ModelOutput(logits, loss, h)
