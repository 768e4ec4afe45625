"""Encoder-decoder transformer (Vaswani et al. 2017; paper section 4.3, Table 3)."""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention.kv_cache import KVCache
from mhe.attention.registry import attention_class
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
        if not attention_class(cfg.attention).supports_cross:
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
        x = self.embed(src_ids, name="src_ids")
        check_mask("src_mask", src_mask, *src_ids.shape)
        mask = as_bool_mask(src_mask)
        for layer in self.encoder_layers:
            x = layer(x, mask=mask)
        return self.encoder_norm(x) if self.encoder_norm is not None else x  # [B, S, m]

    def decode(self, tgt_ids, memory, src_mask=None, tgt_mask=None,
               caches: list[tuple[KVCache, KVCache]] | None = None, *, head: bool = True):
        """The logits ``[B, T, V]`` of each target position (``head=False``: its hidden state)."""
        positions = None
        if caches:  # the new tokens sit at the self-attention caches' write positions
            positions = caches[0][0].index + torch.arange(tgt_ids.shape[1], device=tgt_ids.device)  # [T]
        x = self.embed(tgt_ids, positions=positions, name="tgt_ids")
        if memory.shape[0] != tgt_ids.shape[0]:
            raise MheError(f"tgt_ids has batch {tgt_ids.shape[0]}, the source (memory) has {memory.shape[0]}")
        check_mask("src_mask", src_mask, *memory.shape[:2])
        if not caches:  # with a cache the mask may cover the whole buffer; the attention checks it
            check_mask("tgt_mask", tgt_mask, *tgt_ids.shape)
        src_mask, tgt_mask = as_bool_mask(src_mask), as_bool_mask(tgt_mask)
        for i, layer in enumerate(self.decoder_layers):
            self_cache, cross_cache = caches[i] if caches else (None, None)
            x = layer(x, mask=tgt_mask, context=memory, context_mask=src_mask,
                      cache=self_cache, cross_cache=cross_cache)
        if self.decoder_norm is not None:
            x = self.decoder_norm(x)
        return self.lm_head(x)[..., :self.cfg.vocab_size] if head else x  # [B, T, V]: padding rows never score

    def forward(self, src_ids, tgt_ids, src_mask=None, tgt_mask=None, labels=None, label_smoothing=0.0,
                return_logits=True):
        """Teacher forcing: ``tgt_ids`` are the decoder inputs, ``labels`` the tokens
        each position must predict (-100 ignored). ``return_logits=False``: only the loss is
        needed (below float32 it is scored chunk by chunk, :func:`~mhe.models.losses.head_loss`,
        and ``logits`` is None)."""
        memory = self.encode(src_ids, src_mask)
        check_labels("labels", labels, tgt_ids.shape)
        x = self.decode(tgt_ids, memory, src_mask, tgt_mask, head=False)  # [B, T, m]
        if labels is not None and not return_logits and chunked_loss_wanted(x, self.lm_head.weight):
            return ModelOutput(None, head_loss(self.lm_head, x, labels, vocab_size=self.cfg.vocab_size,
                                               label_smoothing=label_smoothing), memory)
        logits = self.lm_head(x)[..., :self.cfg.vocab_size]  # [B, T, V]
        loss = None if labels is None else token_loss(logits, labels, label_smoothing=label_smoothing)
        return ModelOutput(logits, loss, memory)

    def new_caches(self, batch: int, max_len: int | None = None, src_len: int | None = None,
                   *, dtype=None, device=None) -> list[tuple[KVCache, KVCache]]:
        """(self-attention, cross-attention) caches per decoder layer, sized for the kind."""
        max_len = max_len or self.cfg.max_len
        src_len = src_len or self.cfg.max_len
        return [(layer.self_attn.new_cache(batch, max_len, dtype=dtype, device=device),
                 layer.cross_attn.new_cache(batch, src_len, dtype=dtype, device=device))
                for layer in self.decoder_layers]

    @torch.no_grad()
    def greedy(self, src_ids, src_mask=None, *, bos_id: int, eos_id: int, max_len: int,
               use_cache: bool = True) -> torch.Tensor:
        """Greedy decoding; returns ``[B, <= max_len]`` tokens starting with ``bos_id``."""
        memory = self.encode(src_ids, src_mask)
        b = src_ids.shape[0]
        out = torch.full((b, 1), bos_id, dtype=torch.long, device=src_ids.device)
        caches = self.new_caches(b, max_len, memory.shape[1]) if use_cache else None
        done = torch.zeros(b, dtype=torch.bool, device=src_ids.device)
        for _ in range(max_len - 1):
            step = out[:, -1:] if use_cache else out
            nxt = self.decode(step, memory, src_mask, caches=caches)[:, -1].argmax(-1)
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            out = torch.cat([out, nxt[:, None]], dim=1)
            done |= nxt == eos_id
            if bool(done.all()):
                break
        return out
