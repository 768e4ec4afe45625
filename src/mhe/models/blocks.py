"""Transformer building blocks shared by the three architectures."""

from __future__ import annotations

import math

import torch
from torch import nn

from mhe.attention import attention_from_config
from mhe.attention.kv_cache import CrossCache, KVCache
from mhe.errors import MheError
from mhe.models.config import ModelConfig
from mhe.models.inputs import check_ids
from mhe.models.layers import RMSNorm, activation, build_mlp, build_norm

__all__ = ["Block", "Embeddings", "activation", "build_sublayer", "init_model", "sinusoid_table"]


def build_sublayer(cfg: ModelConfig, *, causal: bool):
    """One attention sublayer of the model's kind, built with its typed configuration."""
    return attention_from_config(cfg.spec, cfg.attention_config(causal=causal))


class Block(nn.Module):
    """One transformer layer: self-attention, optional cross-attention, feed-forward.

    ``norm_first`` picks pre-LN (GPT-2, Llama) or post-LN (BERT, Vaswani et al.); ``cfg.norm``
    LayerNorm or RMSNorm and ``cfg.mlp`` the plain or the SwiGLU feed-forward, or none
    (attention-only: no feed-forward sublayer, no norm before it) (:mod:`mhe.models.layers`). The
    attention modules are built here from the config; the block never looks at
    which kind they are.
    """

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool) -> None:
        super().__init__()
        self.norm_first = cfg.norm_first
        self.self_attn = build_sublayer(cfg, causal=causal)
        self.self_norm = build_norm(cfg)
        self.cross_attn = build_sublayer(cfg, causal=False) if cross else None
        self.cross_norm = build_norm(cfg) if cross else None
        self.ffn = build_mlp(cfg)
        self.ffn_norm = build_norm(cfg) if self.ffn is not None else None
        self.drop = nn.Dropout(cfg.dropout)

    def _residual(self, x, norm, fn):
        if self.norm_first:
            return x + self.drop(fn(norm(x)))
        return norm(x + self.drop(fn(x)))

    def forward(self, x, *, positions=None, mask=None, context=None, context_mask=None,
                cache: KVCache | None = None, cross_cache: CrossCache | None = None, plan=None):
        """``positions``: x's absolute positions (``[B, T]`` or ``[T]``); ``mask`` and
        ``context_mask``: the :class:`~mhe.attention.masks.AttentionMask` the model built once for
        every layer (or key-padding masks, as a sublayer takes them); ``plan``: a decoding run's
        :class:`~mhe.attention.kernels.DecodePlan`, handed to both attention sublayers."""
        x = self._residual(x, self.self_norm, lambda h: self.self_attn(h, positions=positions, mask=mask, cache=cache,
                                                                       plan=plan))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(
                h, positions=positions, context=context, mask=context_mask, cache=cross_cache, plan=plan))
        return x if self.ffn is None else self._residual(x, self.ffn_norm, self.ffn)


class Embeddings(nn.Module):
    """Token + position (+ token type) embeddings, then LayerNorm (post-LN) and dropout."""

    def __init__(self, cfg: ModelConfig, *, norm: bool) -> None:
        super().__init__()
        self.tokens = nn.Embedding(cfg.vocab_size, cfg.d_model, padding_idx=None)
        self.sinusoidal = cfg.positions == "sinusoidal"
        self.positions = None  # rotary positions act inside attention (mhe.attention.rotary)
        self.scale = 1.0
        if self.sinusoidal:
            # computed on first use, not a buffer: it is not a weight, and loaders that build
            # models on the meta device (Hugging Face from_pretrained) leave buffers empty
            self._pos_table: torch.Tensor | None = None
            self.scale = math.sqrt(cfg.d_model)
        elif cfg.positions == "learned":
            self.positions = nn.Embedding(cfg.max_len, cfg.d_model)
        self.types = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps) if norm else None
        self.drop = nn.Dropout(cfg.dropout)
        self.max_len = cfg.max_len

    def token_positions(self, ids: torch.Tensor, *, start: int | torch.Tensor = 0,
                        name: str = "input_ids") -> torch.Tensor:
        """``[T]``: the positions ``start .. start + T - 1`` of ``ids`` [B, T] (``start`` a cache's
        write position, a tensor, or an int checked against ``max_len``)."""
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            check_ids(name, ids, self.tokens.num_embeddings)  # names the misuse
        t = ids.shape[1]
        if isinstance(start, int) and start + t > self.max_len:
            raise MheError(f"{name}: sequence of {start + t} positions exceeds the model's max_len {self.max_len}")
        return start + torch.arange(t, device=ids.device)

    def forward(self, ids: torch.Tensor, *, positions: torch.Tensor | None = None,
                token_types: torch.Tensor | None = None, name: str = "input_ids"):
        """``ids`` [B, T] (``name`` is the argument an error names) -> [B, T, m] at ``positions``
        (``[T]`` or ``[B, T]``; default :meth:`token_positions`, i.e. 0 .. T - 1; e.g. a KV
        cache's write positions, or positions that skip left padding)."""
        check_ids(name, ids, self.tokens.num_embeddings)
        if positions is None:
            positions = self.token_positions(ids, name=name)
        if token_types is not None and self.types is not None:
            check_ids("token_type_ids", token_types, self.types.num_embeddings)
            if token_types.shape != ids.shape:
                raise MheError(f"token_type_ids must have the shape of {name} {tuple(ids.shape)}, "
                               f"got {tuple(token_types.shape)}")
        x = self.tokens(ids) * self.scale
        if self.sinusoidal:
            table = self._pos_table
            if table is None or table.device != x.device:
                table = self._pos_table = sinusoid_table(self.max_len, x.shape[-1]).to(x.device)
            x = x + table[positions].to(x.dtype)
        elif self.positions is not None:
            x = x + self.positions(positions)
        if self.types is not None:  # no token types: every position has type 0 (row 0, without a lookup)
            x = x + (self.types(token_types) if token_types is not None else self.types.weight[0])
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


def sinusoid_table(length: int, dim: int) -> torch.Tensor:
    """Vaswani et al. (2017) section 3.5 position encodings, [length, dim]."""
    pos = torch.arange(length, dtype=torch.float32)[:, None]
    i = torch.arange(0, dim, 2, dtype=torch.float32)
    angle = pos / torch.pow(10000.0, i / dim)
    table = torch.zeros(length, dim)
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return table


def _first_visit(weight: torch.Tensor, seen: set[int]) -> bool:
    """Whether ``weight`` is met for the first time in this pass: a weight tied to an earlier
    module (the output layer to the token embeddings) keeps the earlier module's draw."""
    if id(weight) in seen:
        return False
    seen.add(id(weight))
    return True


def init_weights(model: nn.Module, std: float = 0.02) -> None:
    """BERT/GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit LayerNorm.
    MHE head embeddings keep their own initialisation (see mhe.attention.mhe); an output layer
    tied to the embeddings is drawn once."""
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            if _first_visit(mod.weight, seen):
                nn.init.normal_(mod.weight, std=std)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            if _first_visit(mod.weight, seen):
                nn.init.normal_(mod.weight, std=std)
        elif isinstance(mod, nn.LayerNorm):
            nn.init.ones_(mod.weight)
            nn.init.zeros_(mod.bias)
        elif isinstance(mod, RMSNorm):
            nn.init.ones_(mod.weight)


def init_gpt2(model: nn.Module, n_layers: int) -> None:
    """GPT-2's changes to :func:`init_weights` (Radford et al. 2019, section 2.3: "we scale the
    weights of residual layers at initialization by a factor of 1/sqrt(N) where N is the number
    of residual layers"; N = 2 per block): each block's attention output projection and
    feed-forward output get N(0, 0.02 / sqrt(2 L)); learned positions N(0, 0.01) as in the
    released code (model.py, ``wpe``)."""
    std = 0.02 / math.sqrt(2 * n_layers)
    for block in model.modules():
        if isinstance(block, Block):
            for lin in (getattr(block.self_attn, "out_proj", None), getattr(block.ffn, "out_layer", None)):
                if isinstance(lin, nn.Linear):
                    nn.init.normal_(lin.weight, std=std)
        elif isinstance(block, Embeddings) and block.positions is not None:
            nn.init.normal_(block.positions.weight, std=0.01)


def init_transformer(model: nn.Module, d_model: int) -> None:
    """Vaswani et al. (2017) as in the authors' tensor2tensor code: Glorot-uniform projections
    (``uniform_unit_scaling``: fan-average, uniform), zero biases, token embeddings
    N(0, d_model^-1/2) (multiplied by sqrt(d_model) at the input, section 3.4). An output layer
    tied to the embeddings keeps the embeddings' draw."""
    seen: set[int] = set()
    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            if _first_visit(mod.weight, seen):
                nn.init.xavier_uniform_(mod.weight)
            if mod.bias is not None:
                nn.init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            if _first_visit(mod.weight, seen):
                nn.init.normal_(mod.weight, std=d_model ** -0.5)
        elif isinstance(mod, nn.LayerNorm):
            nn.init.ones_(mod.weight)
            nn.init.zeros_(mod.bias)


def init_model(model: nn.Module, scheme: str = "bert", *, n_layers: int = 1, d_model: int = 1) -> None:
    """Initialise every weight as the family's original does, then each MHE sublayer's own
    head-embedding initialisation.

    Args:
        scheme: ``bert`` (:func:`init_weights`), ``gpt2`` (:func:`init_weights` then
            :func:`init_gpt2`) or ``transformer`` (:func:`init_transformer`).
        n_layers: blocks per stack (``gpt2``'s residual scaling).
        d_model: model width (``transformer``'s embedding scale).
    """
    if scheme == "transformer":
        init_transformer(model, d_model)
    else:
        init_weights(model)
        if scheme == "gpt2":
            init_gpt2(model, n_layers)
    for mod in model.modules():
        if hasattr(mod, "reset_head_embeddings"):
            mod.reset_head_embeddings()
