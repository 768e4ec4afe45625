"""The network of an exported mhe run in plain torch: norms, positions, every attention kind,
blocks, masks and the encoder and decoder stacks (no mhe and no transformers needed).
``modeling_mhe.py`` beside it wraps these as transformers models; the kinds and the LoRA
targets are described there.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_mhe import KINDS, cache_heads


def head_dim(s: dict) -> int:
    return s.get("head_dim") or s["d_model"] // s["n_heads"]


# ------------------------------------------------------------------ per-position layers
class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * g`` (Zhang & Sennrich 2019), the statistic in at least float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def build_norm(s: dict) -> nn.Module:
    eps = s.get("layer_norm_eps", 1e-5)
    return RMSNorm(s["d_model"], eps) if s.get("norm") == "rmsnorm" else nn.LayerNorm(s["d_model"], eps=eps)


def activation(name: str) -> nn.Module:
    """``gelu`` (erf), ``gelu_tanh`` or ``relu``."""
    return nn.ReLU() if name == "relu" else nn.GELU(approximate="tanh" if name == "gelu_tanh" else "none")


class FeedForward(nn.Module):
    """``fc_out(act(fc_in(x)))`` with biases (Vaswani et al. 2017, Eq. 2)."""

    def __init__(self, s: dict) -> None:
        super().__init__()
        self.fc_in = nn.Linear(s["d_model"], s["d_ff"])
        self.fc_out = nn.Linear(s["d_ff"], s["d_model"])
        self.act = activation(s.get("activation", "gelu"))
        self.drop = nn.Dropout(s.get("dropout", 0.0))

    def forward(self, x):
        return self.fc_out(self.drop(self.act(self.fc_in(x))))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` without biases (Shazeer 2020, Eq. 6; Llama's MLP)."""

    def __init__(self, s: dict) -> None:
        super().__init__()
        self.gate = nn.Linear(s["d_model"], s["d_ff"], bias=False)
        self.up = nn.Linear(s["d_model"], s["d_ff"], bias=False)
        self.down = nn.Linear(s["d_ff"], s["d_model"], bias=False)
        self.drop = nn.Dropout(s.get("dropout", 0.0))

    def forward(self, x):
        return self.down(self.drop(F.silu(self.gate(x)) * self.up(x)))


# ------------------------------------------------------------------ positions
def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Rotary:
    """RoPE (Su et al. 2021) with half-split pairs over the first ``rope_fraction`` of each head,
    angles in float32 as Llama computes them; no weights (its constants are made on the CPU, also
    when transformers builds the model on the meta device)."""

    def __init__(self, s: dict) -> None:
        d = head_dim(s)
        self.width = int(d * s.get("rope_fraction", 1.0))
        r = self.width
        steps = torch.arange(0, r, 2, dtype=torch.int64, device="cpu").float() / r
        self.inv_freq = 1.0 / (float(s.get("rope_base", 10000.0)) ** steps)  # Llama's inv_freq

    def __call__(self, x, positions):
        """``x [B, h, T, d]`` rotated by ``positions`` (``[T]`` or ``[B, T]``)."""
        angles = positions.to(torch.float32)[..., None] * self.inv_freq.to(positions.device)
        angles = torch.cat((angles, angles), -1)  # [.., T, r]
        if positions.dim() == 2:
            angles = angles[:, None]
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        r = self.width
        rot, keep = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, keep), -1)


def sinusoid_table(length: int, dim: int):
    """Vaswani et al. (2017) section 3.5, in float32 on the CPU."""
    pos = torch.arange(length, dtype=torch.float32, device="cpu")[:, None]
    i = torch.arange(0, dim, 2, dtype=torch.float32, device="cpu")
    angle = pos / torch.pow(10000.0, i / dim)
    table = torch.zeros(length, dim, device="cpu")
    table[:, 0::2] = torch.sin(angle)
    table[:, 1::2] = torch.cos(angle[:, : dim // 2])
    return table


class Embeddings(nn.Module):
    """Tokens + learned or sinusoidal positions (rotary ones act in attention) + token types,
    then LayerNorm (post-LN encoder) and dropout."""

    def __init__(self, s: dict, *, norm: bool) -> None:
        super().__init__()
        m = s["d_model"]
        self.tokens = nn.Embedding(s["vocab_size"], m)
        kind = s.get("positions", "learned")
        self.positions = nn.Embedding(s["max_len"], m) if kind == "learned" else None
        self.table = sinusoid_table(s["max_len"], m) if kind == "sinusoidal" else None
        self.scale = math.sqrt(m) if kind == "sinusoidal" else 1.0
        types = s.get("type_vocab_size", 0)
        self.types = nn.Embedding(types, m) if types else None
        self.norm = nn.LayerNorm(m, eps=s.get("layer_norm_eps", 1e-5)) if norm else None
        self.drop = nn.Dropout(s.get("dropout", 0.0))

    def forward(self, ids, positions, token_types=None):
        x = self.tokens(ids) * self.scale
        if self.table is not None:
            x = x + self.table.to(x.device)[positions].to(x.dtype)
        elif self.positions is not None:
            x = x + self.positions(positions)
        if self.types is not None:
            x = x + (self.types(token_types) if token_types is not None else self.types.weight[0])
        if self.norm is not None:
            x = self.norm(x)
        return self.drop(x)


# ------------------------------------------------------------------ attention
def split_heads(t, n):
    b, s, _ = t.shape
    return t.view(b, s, n, -1).transpose(1, 2)  # [B, n, S, d]


def merge_heads(h):
    b, n, t, d = h.shape
    return h.transpose(1, 2).reshape(b, t, n * d)


class Attention(nn.Module):
    """One attention sublayer of any kind with keys and values (see the module docstring)."""

    def __init__(self, s: dict, *, causal: bool) -> None:
        super().__init__()
        kind, m, n, d = s["attention"], s["d_model"], s["n_heads"], head_dim(s)
        bias = bool(s.get("attn_bias", False))
        in_bias = bias or bool(s.get("qkv_bias", False))
        opts = s.get("attn_options") or {}
        self.kind, self.n, self.d, self.causal = kind, n, d, causal
        _, self.proj, self.psi = KINDS[kind]  # projections, MHE's psi (the table in configuration_mhe)
        self.tiled = self.proj == "seed" and not self.psi  # sha: one head tiled n times
        self.dropout = float(s.get("attn_dropout", 0.0))
        self.g = cache_heads(s) if self.proj == "heads" else n
        seed = self.proj == "seed"
        self.q_proj = nn.Linear(m, d if seed else n * d, bias=in_bias)
        if self.proj == "shared":
            self.kv_proj = nn.Linear(m, n * d, bias=in_bias)
        elif self.proj != "input":
            self.k_proj = nn.Linear(m, d if seed else self.g * d, bias=in_bias)
            self.v_proj = nn.Linear(m, d if seed else self.g * d, bias=in_bias)
        self.out_proj = nn.Linear(n * d, m, bias=bias)
        if self.psi:
            self.head_embed = nn.Parameter(torch.zeros(3, n, d))  # [q|k|v, n, d]
            self.mul = self.psi == "mul"
            self.psi_first = s.get("positions") == "rotary" and opts.get("rope_order") == "psi-then-rope"

    # --- MHE: psi(A, e) per head (paper section 3.4) ---------------------------------
    def _psi(self, a, e):
        """``a [B, 1|n, S, d]``, ``e [n, d]`` -> ``[B, n, S, d]``."""
        e = e[None, :, None, :]
        return a * (e + 1) if self.mul else a + e

    def _literal(self) -> bool:
        """n explicit heads: psi before the rotation; MHE-Add under attention dropout (its
        value offsets average out only when attention rows sum to one)."""
        return self.psi_first or (not self.mul and self.training and self.dropout > 0)

    def _embed(self, a, e, positions, rope):
        if self.psi_first:
            return _rotate(rope, self._psi(a, e), positions)
        return self._psi(_rotate(rope, a, positions), e)

    # --- projections -------------------------------------------------------------
    def queries(self, x, positions, rope):
        if self.tiled:
            return _rotate(rope, self.q_proj(x).unsqueeze(1), positions)
        if not self.psi:
            return _rotate(rope, split_heads(self.q_proj(x), self.n), positions)
        q = self.q_proj(x).unsqueeze(1)  # [B, 1, T, d]: the seed query
        e = self.head_embed
        if self._literal():
            return self._embed(q, e[0], positions, rope)
        q = _rotate(rope, q, positions)
        if self.mul:  # (Q*(1+eQ_i)) . (K*(1+eK_i)) = (Q*(1+eQ_i)*(1+eK_i)) . K
            return q * ((e[0] + 1) * (e[1] + 1))[None, :, None, :]
        return q + e[0][None, :, None, :]  # (Q+eQ_i) . (K+eK_i): the eK term is constant along keys

    def keys_values(self, src, positions, rope):
        if self.proj == "shared":
            kv = split_heads(self.kv_proj(src), self.n)
            return _rotate(rope, kv, positions), kv
        if self.proj == "input":
            kv = split_heads(src, self.n)
            return _rotate(rope, kv, positions), kv
        if self.proj == "heads":
            k, v = split_heads(self.k_proj(src), self.g), split_heads(self.v_proj(src), self.g)
            return _rotate(rope, k, positions), v
        k, v = self.k_proj(src).unsqueeze(1), self.v_proj(src).unsqueeze(1)  # [B, 1, S, d]
        if self.psi and self._literal():
            return self._embed(k, self.head_embed[1], positions, rope), self._psi(v, self.head_embed[2])
        return _rotate(rope, k, positions), v  # one shared head

    def output(self, h):
        if self.tiled:  # one head tiled n times, then the (n*d) x m projection
            return self.out_proj(h[:, 0].repeat(1, 1, self.n))
        if self.psi and not self._literal():
            h = self._psi(h, self.head_embed[2])  # A_i (V*(1+eV_i)) = (A_i V)*(1+eV_i); Add: + eV_i
        return self.out_proj(merge_heads(h))

    def forward(self, x, *, positions, mask, rope=None, context=None, cache=None, layer=0, padding=None):
        q = self.queries(x, positions, rope)  # [B, n, T, d]
        if context is None:
            k, v = self.keys_values(x, positions, rope)
            if cache is not None:
                k, v = cache.update(k, v, layer)  # [B, h_kv, L, d]
        else:
            k, v = self.keys_values(context, None, None)
        m = mask(k.shape[2]) if callable(mask) else mask
        return self.output(attend(q, k, v, m, self.dropout if self.training else 0.0))


def _rotate(rope, t, positions):
    return t if rope is None or positions is None else rope(t, positions)


def attend(q, k, v, mask, dropout_p: float):
    """Scaled dot-product attention, the K/V heads shared by n/g query heads each."""
    n, g = q.shape[1], k.shape[1]
    if g != n:
        k, v = k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


class Mixing(nn.Module):
    """FNet (Re(FFT2(x))) or linear mixing (``hidden_mix(W_seq x)``), Lee-Thorp et al. (2022)."""

    def __init__(self, s: dict, *, causal: bool) -> None:
        super().__init__()
        self.kind, self.causal = s["attention"], causal
        if self.kind == "linear":
            size = (s.get("attn_options") or {}).get("max_len") or s["max_len"]
            self.seq_mix = nn.Parameter(torch.zeros(size, size))
            self.hidden_mix = nn.Linear(s["d_model"], s["d_model"], bias=bool(s.get("attn_bias", False)))

    def forward(self, x, *, padding=None, **unused):
        if padding is not None:
            x = x * padding[..., None].to(x.dtype)
        if self.kind == "fnet":
            low = x.dtype in (torch.float16, torch.bfloat16)
            return torch.fft.fft2(x.float() if low else x, dim=(-2, -1)).real.to(x.dtype)
        t = x.shape[1]
        w = self.seq_mix[:t, :t]
        return self.hidden_mix(torch.einsum("st,btm->bsm", torch.tril(w) if self.causal else w, x))


class Block(nn.Module):
    """Self-attention, optional cross-attention, feed-forward; pre-LN or post-LN."""

    def __init__(self, s: dict, *, causal: bool, cross: bool) -> None:
        super().__init__()
        sublayer = Mixing if KINDS[s["attention"]][1] == "mixing" else Attention
        self.norm_first = bool(s.get("norm_first", False))
        self.self_attn = sublayer(s, causal=causal)
        self.self_norm = build_norm(s)
        self.cross_attn = Attention(s, causal=False) if cross else None
        self.cross_norm = build_norm(s) if cross else None
        self.ffn = SwiGLU(s) if s.get("mlp") == "swiglu" else FeedForward(s)
        self.ffn_norm = build_norm(s)
        self.drop = nn.Dropout(s.get("dropout", 0.0))

    def _residual(self, x, norm, fn):
        if self.norm_first:
            return x + self.drop(fn(norm(x)))
        return norm(x + self.drop(fn(x)))

    def forward(self, x, *, positions, mask, padding=None, rope=None, cache=None, layer=0, context=None,
                context_mask=None):
        x = self._residual(x, self.self_norm, lambda h: self.self_attn(
            h, positions=positions, mask=mask, rope=rope, cache=cache, layer=layer, padding=padding))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(
                h, positions=positions, mask=context_mask, context=context))
        return self._residual(x, self.ffn_norm, self.ffn)


# ------------------------------------------------------------------ masks
def key_padding(attention_mask):
    """A 2D mask (1 = real token) as bool ``[B, S]``; None stays None."""
    return None if attention_mask is None else attention_mask.to(torch.bool)


def self_attention_mask(attention_mask, t: int, start: int, causal: bool, device):
    """A function of the key length L giving the boolean mask ``[B|1, 1, T, L]`` (True: attend)
    of T new tokens at positions ``start ..``: causal over absolute positions, and the padding
    of a 2D ``attention_mask`` over the keys it covers. A 4D mask (what ``generate`` builds for
    a static cache) is used as it is. A query without any key (a padding query) sees all keys,
    so that its (unused) output stays finite."""
    if attention_mask is not None and attention_mask.dim() == 4:
        m4 = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        return lambda keys: m4[..., :keys]
    pad = key_padding(attention_mask)
    made = {}

    def build(keys: int):
        if keys not in made:
            q = start + torch.arange(t, device=device)
            m = torch.arange(keys, device=device)[None, :] <= q[:, None] if causal else \
                torch.ones(t, keys, dtype=torch.bool, device=device)
            m = m[None]  # [1, T, L]
            if pad is not None:
                p = pad[:, :keys]
                if p.shape[1] < keys:
                    p = torch.cat([p, p.new_ones(p.shape[0], keys - p.shape[1])], 1)
                m = m & p[:, None, :]
            made[keys] = (m | ~m.any(-1, keepdim=True))[:, None]
        return made[keys]

    return build


def padding_mask(attention_mask):
    """``[B, 1, 1, S]`` from a 2D mask, or None."""
    pad = key_padding(attention_mask)
    return None if pad is None else pad[:, None, None, :]


def _cache_arg(kwargs: dict):
    return kwargs.pop("cache", None) or kwargs.pop("past_key_values", None)


# ------------------------------------------------------------------ stacks
class Decoder(nn.Module):
    """Pre-LN causal stack: GPT-2-like (learned positions, LayerNorm, GELU) or Llama-style
    (rotary positions, RMSNorm, SwiGLU)."""

    def __init__(self, s: dict) -> None:
        super().__init__()
        self.embed = Embeddings(s, norm=False)
        self.layers = nn.ModuleList(Block(s, causal=True, cross=False) for _ in range(s["n_layers"]))
        self.final_norm = build_norm(s)
        self.rope = Rotary(s) if s.get("positions") == "rotary" else None

    def forward(self, input_ids, attention_mask=None, cache=None, position_ids=None):
        t = input_ids.shape[1]
        start = cache.get_seq_length() if cache is not None else 0
        positions = position_ids if position_ids is not None else start + torch.arange(t, device=input_ids.device)
        x = self.embed(input_ids, positions)
        mask = self_attention_mask(attention_mask, t, start, True, input_ids.device)
        padding = key_padding(attention_mask) if attention_mask is not None and attention_mask.dim() == 2 else None
        for i, layer in enumerate(self.layers):
            x = layer(x, positions=positions, mask=mask, padding=padding, rope=self.rope, cache=cache, layer=i)
        return self.final_norm(x)


class Encoder(nn.Module):
    """Bidirectional stack (BERT: post-LN, learned positions, token types)."""

    def __init__(self, s: dict) -> None:
        super().__init__()
        first = bool(s.get("norm_first", False))
        self.embed = Embeddings(s, norm=not first)
        self.layers = nn.ModuleList(Block(s, causal=False, cross=False) for _ in range(s["n_layers"]))
        self.final_norm = nn.LayerNorm(s["d_model"], eps=s.get("layer_norm_eps", 1e-5)) if first else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids, positions, token_type_ids)
        mask, padding = padding_mask(attention_mask), key_padding(attention_mask)
        for layer in self.layers:
            x = layer(x, positions=positions, mask=mask, padding=padding)
        return self.final_norm(x) if self.final_norm is not None else x
