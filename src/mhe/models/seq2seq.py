"""Encoder-decoder transformer (Vaswani et al. 2017; paper section 4.3, Table 3)."""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention import masks
from mhe.attention.kernels import DecodePlan
from mhe.attention.kv_cache import CrossCache, KVCache, check_layer_caches, layer_caches
from mhe.attention.masks import AttentionMask
from mhe.errors import MheError
from mhe.models.blocks import Block, Embeddings, init_model
from mhe.models.config import ModelConfig
from mhe.models.inputs import check_labels, check_mask
from mhe.models.losses import chunked_loss_wanted, head_loss, token_loss
from mhe.models.outputs import ModelOutput, as_bool_mask


class EncoderDecoder(nn.Module):
    """Shared source/target vocabulary, one embedding table tied to the output layer.

    Encoder self-attention, decoder causal self-attention and decoder
    cross-attention all use ``cfg.attention`` (3 * n_layers sublayers).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if not cfg.spec.layer_class.supports_cross:
            raise MheError(f"attention kind {cfg.attention!r} cannot cross-attend, so it cannot build an "
                           "encoder-decoder; use it in an encoder or decoder")
        self.cfg = cfg
        self.embed = Embeddings(cfg, norm=False)
        self.encoder_layers = nn.ModuleList(Block(cfg, causal=False, cross=False) for _ in range(cfg.n_layers))
        self.decoder_layers = nn.ModuleList(Block(cfg, causal=True, cross=True) for _ in range(cfg.n_layers))
        eps = cfg.layer_norm_eps
        self.encoder_norm = nn.LayerNorm(cfg.d_model, eps=eps) if cfg.norm_first else None
        self.decoder_norm = nn.LayerNorm(cfg.d_model, eps=eps) if cfg.norm_first else None
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight
        self.vocab_modules = ("embed.tokens", "lm_head")  # a row per token (mhe.models.vocab_padding)

    def reset_parameters(self) -> None:
        """(Re)draw every weight by the Transformer's scheme (:func:`mhe.models.blocks.init_model`);
        run when built, and by the Hugging Face adapter when it builds its own core."""
        init_model(self, "transformer", d_model=self.cfg.d_model)

    def encode(self, src_ids, src_mask=None):
        positions = self.embed.token_positions(src_ids, name="src_ids")  # [S], for every layer
        x = self.embed(src_ids, positions=positions, name="src_ids")
        check_mask("src_mask", src_mask, *src_ids.shape)
        mask = masks.padding_mask(as_bool_mask(src_mask))  # once, for every layer
        for layer in self.encoder_layers:
            x = layer(x, positions=positions, mask=mask)
        return self.encoder_norm(x) if self.encoder_norm is not None else x  # [B, S, m]

    def decode(self, tgt_ids, memory, src_mask=None, tgt_mask=None,
               caches: list[tuple[KVCache, CrossCache]] | None = None, *, head: bool = True,
               plan: DecodePlan | None = None):
        """The logits ``[B, T, V]`` of ``tgt_ids`` ``[B, T]`` reading ``memory`` ``[B, S, m]``
        (``head=False``: the hidden states).

        With ``caches`` (:meth:`new_caches`) the new tokens sit at the self-attention caches'
        write position and ``tgt_mask`` covers the cache (``[B, L]``) or every position so far,
        or is an :class:`~mhe.attention.masks.AttentionMask` built by the caller (beam search's
        window). Positions and both masks are made once and handed to every layer, with ``plan``,
        a decoding run's :class:`~mhe.attention.kernels.DecodePlan` (the kernel of the decoder's
        self- and cross-attention; None: the configured kernel over dense masks).
        """
        if caches:
            check_layer_caches([own for own, _ in caches])
        start = caches[0][0].index if caches else 0  # where the new tokens go in the caches
        positions = self.embed.token_positions(tgt_ids, start=start, name="tgt_ids")
        x = self.embed(tgt_ids, positions=positions, name="tgt_ids")
        if memory.shape[0] != tgt_ids.shape[0]:
            raise MheError(f"tgt_ids has batch {tgt_ids.shape[0]}, the source (memory) has {memory.shape[0]}")
        check_mask("src_mask", src_mask, *memory.shape[:2])
        self_mask = tgt_mask
        if not isinstance(self_mask, AttentionMask):
            check_mask("tgt_mask", tgt_mask, tgt_ids.shape[0], None if caches else tgt_ids.shape[1])
            self_mask = masks.self_attention_mask(tgt_ids, as_bool_mask(tgt_mask), start=start,
                                                  keys=caches[0][0].max_len if caches else None, plan=plan)
        cross_mask = masks.padding_mask(as_bool_mask(src_mask))
        for i, layer in enumerate(self.decoder_layers):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = layer(x, positions=positions, mask=self_mask, context=memory, context_mask=cross_mask,
                      cache=self_cache, cross_cache=cross_cache, plan=plan)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.lm_head(x)[..., :self.cfg.vocab_size] if head else x  # [B, T, V]: padding rows never score

    def forward(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, labels=None, label_smoothing=0.0,
                return_logits=True, chunked_loss=None):
        """Teacher forcing: ``tgt_ids`` are the decoder inputs, ``labels`` the tokens
        each position must predict (-100 ignored). ``return_logits=False``: only the loss is
        needed (below float32 it is scored chunk by chunk, :func:`~mhe.models.losses.head_loss`,
        and ``logits`` is None; ``chunked_loss`` True or False chooses,
        :func:`~mhe.models.losses.chunked_loss_wanted`)."""
        memory = self.encode(src_ids, src_mask)
        check_labels("labels", labels, tgt_ids.shape)
        x = self.decode(tgt_ids, memory, src_mask, tgt_mask, head=False)  # [B, T, m]
        if labels is not None and not return_logits and chunked_loss_wanted(x, self.lm_head.weight, chunked_loss):
            return ModelOutput(None, head_loss(self.lm_head, x, labels, vocab_size=self.cfg.vocab_size,
                                               label_smoothing=label_smoothing), memory)
        logits = self.lm_head(x)[..., :self.cfg.vocab_size]  # [B, T, V]
        loss = None if labels is None else token_loss(logits, labels, label_smoothing=label_smoothing)
        return ModelOutput(logits, loss, memory)

    def new_caches(self, batch: int, max_len: int | None = None, *, dtype=None,
                   device=None) -> list[tuple[KVCache, CrossCache]]:
        """(self-attention, cross-attention) caches per decoder layer: a static cache sized for the
        kind, and a store for the encoder's keys and values (filled at the first step, or by
        :meth:`fill_cross_caches`)."""
        selfs = layer_caches((layer.self_attn for layer in self.decoder_layers), batch, max_len or self.cfg.max_len,
                             dtype=dtype, device=device)
        return [(cache, CrossCache()) for cache in selfs]

    def fill_cross_caches(self, memory: torch.Tensor, caches: list[tuple[KVCache, CrossCache]]) -> None:
        """Store every decoder layer's cross-attention keys and values of ``memory`` ``[B, S, m]``
        (in place where the stores already hold tensors of that shape)."""
        for layer, (_, cross) in zip(self.decoder_layers, caches):
            cross.store(*layer.cross_attn.cross_keys_values(memory))

    def beam_search(self, src_ids: torch.Tensor, src_mask: torch.Tensor | None = None, *, bos_id: int, eos_id: int,
                    **options):
        """The best translation per source by beam search, ``[B, L]`` from ``bos_id`` (see
        :func:`mhe.generation.beam.beam_search` for the options: ``beam``, ``max_len``, ``alpha``,
        ``step_mode``, ``compile_options``, a reusable ``searcher``, ``return_scores``)."""
        from mhe.generation.beam import beam_search  # decoding code loads when first used, not with the model

        return beam_search(self, src_ids, src_mask, bos_id=bos_id, eos_id=eos_id, **options)
