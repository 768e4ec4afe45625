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

from .decode_mhe import fits, flash_decode, key_range, mark_cache, marked  # (a named module: transformers copies it)
from .configuration_mhe import KINDS, cache_heads

MHE_KINDS = tuple(k for k, (_, _, psi) in KINDS.items() if psi)  # read from the one table of kinds
MIXING_KINDS = tuple(k for k, (_, how, _) in KINDS.items() if how == "mixing")


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


class Rotary(nn.Module):
    """RoPE (Su et al. 2021) with half-split pairs over the first ``rope_fraction`` of each head.
    The angles, cosines and sines of positions ``0 .. max_len - 1`` are one float32 table made on
    the CPU (``pos * inv_freq`` as Llama computes them; also when transformers builds the model on
    the meta device) and copied where the model goes, so every card rotates by the constants mhe
    uses. No weights; a plain attribute, not a buffer (nothing in a state dict)."""

    def __init__(self, s: dict) -> None:
        super().__init__()
        r = self.width = int(head_dim(s) * s.get("rope_fraction", 1.0))
        steps = torch.arange(0, r, 2, dtype=torch.int64, device="cpu").float() / r
        inv_freq = 1.0 / (float(s.get("rope_base", 10000.0)) ** steps)  # Llama's inv_freq
        angles = torch.arange(s["max_len"], dtype=torch.int64, device="cpu").float()[:, None] * inv_freq[None]
        angles = torch.cat((angles, angles), -1)  # [max_len, r]: pair (i, i + r/2) shares its angle
        self._cpu = (angles.cos(), angles.sin())
        self._table = self._cpu

    def table(self, device):
        """``cos, sin [max_len, r]`` float32 on ``device`` (copied there once)."""
        if self._table[0].device != device:
            self._table = tuple(_static(t.to(device)) for t in self._cpu)
        return self._table

    def _apply(self, fn, recurse=True):
        target = fn(torch.zeros((), device=self._table[0].device)).device  # .to(device), .cuda(): it follows
        if target.type != "meta":
            self.table(target)
        return super()._apply(fn, recurse)

    def at(self, positions, dtype) -> "Rotation":
        """The rotation of every layer's queries and keys at ``positions`` (``[T]`` or ``[B, T]``),
        made once a forward."""
        cos, sin = (t[positions].to(dtype) for t in self.table(positions.device))  # [T, r] or [B, T, r]
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, r]
        return Rotation(cos, sin, self.width)


class Rotation:
    """RoPE at fixed positions: ``x [B, h, T, d]`` rotated over its first ``width`` dimensions."""

    def __init__(self, cos, sin, width: int) -> None:
        self.cos, self.sin, self.width = cos, sin, width

    def __call__(self, x):
        r = self.width
        if r == x.shape[-1]:
            return x * self.cos + rotate_half(x) * self.sin
        rot, keep = x[..., :r], x[..., r:]
        return torch.cat((rot * self.cos + rotate_half(rot) * self.sin, keep), -1)


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
        self.dropout = float(s.get("attn_dropout", 0.0))
        self.g = cache_heads(s) if kind in ("mha", "mqa", "gqa") else n
        seed = kind in MHE_KINDS or kind == "sha"
        self.q_proj = nn.Linear(m, d if seed else n * d, bias=in_bias)
        if kind == "skv":
            self.kv_proj = nn.Linear(m, n * d, bias=in_bias)
        elif kind != "el-att":
            self.k_proj = nn.Linear(m, d if seed else self.g * d, bias=in_bias)
            self.v_proj = nn.Linear(m, d if seed else self.g * d, bias=in_bias)
        self.out_proj = nn.Linear(n * d, m, bias=bias)
        if kind in MHE_KINDS:
            self.head_embed = nn.Parameter(torch.zeros(3, n, d))  # [q|k|v, n, d]
            self.mul = kind == "mhe-mul"
            self.psi_first = s.get("positions") == "rotary" and opts.get("rope_order") == "psi-then-rope"
            self._fold_key = None

    # --- MHE: psi(A, e) per head (paper section 3.4) ---------------------------------
    def _psi(self, a, e):
        """``a [B, 1|n, S, d]``, ``e [n, d]`` -> ``[B, n, S, d]``."""
        e = e[None, :, None, :]
        return a * (e + 1) if self.mul else a + e

    def _literal(self) -> bool:
        """n explicit heads: psi before the rotation; MHE-Add under attention dropout (its
        value offsets average out only when attention rows sum to one)."""
        return self.psi_first or (not self.mul and self.training and self.dropout > 0)

    def _embed(self, a, e, rope):
        if self.psi_first:
            return _rotate(rope, self._psi(a, e))
        return self._psi(_rotate(rope, a), e)

    def _query_factors(self):
        """Mul: (Q*(1+eQ_i)) . (K*(1+eK_i)) = (Q*(1+eQ_i)*(1+eK_i)) . K; Add: (Q+eQ_i) . (K+eK_i)
        differs from (Q+eQ_i) . K by a term constant along the keys. ``[n, d]``."""
        e = self.head_embed
        return (e[0] + 1) * (e[1] + 1) if self.mul else e[0]

    def _folded_output(self):
        """The output weight and bias over the heads' outputs from the shared V: Mul,
        A_i (V*(1+eV_i)) = (A_i V)*(1+eV_i), W^O's columns scaled; Add, A_i (V + eV_i) = A_i V + eV_i,
        the bias b^O + W^O eV (a product of elements and a sum, as mhe makes it)."""
        w, b, e = self.out_proj.weight, self.out_proj.bias, self.head_embed[2].reshape(1, -1)
        if self.mul:
            return w * (e + 1), b
        offset = (w * e).sum(-1)
        return w, offset if b is None else b + offset

    # --- the inference fold: an eval call without gradients reads tensors made once -------
    def _plain_output(self) -> bool:
        return type(self.out_proj) is nn.Linear  # an adapter (peft) wraps it: then it is called as it is

    def _fold_key_now(self):
        parts = [self.head_embed] + ([self.out_proj.weight, self.out_proj.bias] if self._plain_output() else [])
        return tuple(_stamp(t) for t in parts)

    def folded(self):
        """(query factors ``[n, d]``, output weight, output bias) kept as buffers (outside the state
        dict) for an MHE sublayer in eval mode without gradients, made at its first such call and
        again whenever the weights they come from change (an optimiser step, a load, ``.to``); the
        weight is None where ``out_proj`` carries an adapter. None: compute from the weights (training,
        gradients wanted, n explicit heads, other kinds). Inside ``torch.compile`` the buffers made
        by the last eager call are read as they are (generate's prefill runs eagerly first)."""
        if self.kind not in MHE_KINDS or self.training or self._literal():
            return None
        if torch.is_grad_enabled() and (self.head_embed.requires_grad or self.out_proj.weight.requires_grad):
            return None
        if not _compiling():
            key = self._fold_key_now()
            if key != self._fold_key:
                self._fold(key)
        f = self._buffers.get("fold_query")
        return None if f is None else (f, self._buffers.get("fold_out_weight"), self._buffers.get("fold_out_bias"))

    @torch.no_grad()
    def _fold(self, key) -> None:
        w, b = self._folded_output() if self._plain_output() else (None, None)
        for name, t in (("fold_query", self._query_factors()), ("fold_out_weight", w), ("fold_out_bias", b)):
            self.register_buffer(name, None if t is None else _static(t.detach()), persistent=False)
        self._fold_key = key

    def _drop_folds(self) -> None:
        for name in ("fold_query", "fold_out_weight", "fold_out_bias"):
            self._buffers.pop(name, None)
        self._fold_key = None

    def train(self, mode: bool = True):
        """Also drops the kept folds: training computes from the weights, and ``eval()`` (loaders
        such as ``from_pretrained`` and peft's call it) makes them again at the next call, so a write
        no version counter sees (through ``.data``) is seen after it."""
        if self.kind in MHE_KINDS:
            self._drop_folds()
        return super().train(mode)

    def __setattr__(self, name, value):
        if name == "out_proj" and "fold_query" in self.__dict__.get("_buffers", {}):
            self._drop_folds()  # an adapter wraps W^O or is merged into it through .data (peft): fold anew
        super().__setattr__(name, value)

    # --- projections -------------------------------------------------------------
    def queries(self, x, rope, folded=None):
        if self.kind == "sha":
            return _rotate(rope, self.q_proj(x).unsqueeze(1))
        if self.kind not in MHE_KINDS:
            return _rotate(rope, split_heads(self.q_proj(x), self.n))
        q = self.q_proj(x).unsqueeze(1)  # [B, 1, T, d]: the seed query
        if self._literal():
            return self._embed(q, self.head_embed[0], rope)
        q = _rotate(rope, q)
        f = (self._query_factors() if folded is None else folded[0])[None, :, None, :]
        return q * f if self.mul else q + f  # [B, n, T, d]

    def keys_values(self, src, rope):
        kind = self.kind
        if kind == "skv":
            kv = split_heads(self.kv_proj(src), self.n)
            return _rotate(rope, kv), kv
        if kind == "el-att":
            kv = split_heads(src, self.n)
            return _rotate(rope, kv), kv
        if kind not in MHE_KINDS and kind != "sha":
            k, v = split_heads(self.k_proj(src), self.g), split_heads(self.v_proj(src), self.g)
            return _rotate(rope, k), v
        k, v = self.k_proj(src).unsqueeze(1), self.v_proj(src).unsqueeze(1)  # [B, 1, S, d]
        if kind in MHE_KINDS and self._literal():
            return self._embed(k, self.head_embed[1], rope), self._psi(v, self.head_embed[2])
        return _rotate(rope, k), v  # one shared head

    def output(self, h, folded=None):
        if self.kind == "sha":  # one head tiled n times, then the (n*d) x m projection
            return self.out_proj(h[:, 0].repeat(1, 1, self.n))
        if self.kind in MHE_KINDS and not self._literal():
            if folded is not None and folded[1] is not None:
                return F.linear(merge_heads(h), folded[1], folded[2])
            h = self._psi(h, self.head_embed[2])  # A_i (V*(1+eV_i)) = (A_i V)*(1+eV_i); Add: + eV_i
        return self.out_proj(merge_heads(h))

    def forward(self, x, *, mask, rope=None, context=None, cache=None, layer=0, padding=None):
        folded = self.folded() if self.kind in MHE_KINDS else None
        q = self.queries(x, rope, folded)  # [B, n, T, d]
        if context is None:
            k, v = self.keys_values(x, rope)
            if cache is not None:
                k, v = cache.update(k, v, layer)  # [B, h_kv, L, d]
        else:
            k, v = self.keys_values(context, None)
        m, causal = mask(k.shape[2]) if callable(mask) else (mask, False)
        dropout = self.dropout if self.training else 0.0
        if getattr(mask, "runs", False) and fits(q, k, v, m, causal, dropout):  # a decode step, one K/V head
            b, n, _, d = q.shape
            h = flash_decode(q.reshape(b, 1, n, d), k, v, mask.ranges(k.shape[2], b)).view(b, n, 1, d)
        else:
            h = attend(q, k, v, m, dropout, causal)
        return self.output(h, folded)


def _rotate(rope, t):
    return t if rope is None else rope(t)


_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


def _gqa_fused(q) -> bool:
    """Whether SDPA reads grouped K/V heads (``enable_gqa``, no mask) on a fused kernel: the CPU's;
    on CUDA FlashAttention-2 (fp16/bf16, head_dim <= 256), and the memory-efficient kernel from
    torch 2.14 on. Elsewhere SDPA falls to its math backend, which writes out every score."""
    if q.device.type != "cuda" or _TORCH >= (2, 14):
        return True
    dtype = q.dtype
    if dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    return dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _stamp(t):
    """What changes when a weight changes: its storage, its in-place version, its dtype (None: no bias)."""
    if t is None:
        return None
    try:
        return t.data_ptr(), t._version, t.dtype
    except RuntimeError:  # an inference-mode tensor keeps no version: treat it as changed
        return object()


def _static(t):
    """``t`` marked as a fixed address for CUDA graphs (as transformers marks its static cache), so
    that a captured step reads it where it is instead of copying it in at every replay."""
    if t.is_cuda and not _compiling():
        torch._dynamo.mark_static_address(t)
    return t


def attend(q, k, v, mask, dropout_p: float, causal: bool = False):
    """Scaled dot-product attention of ``q [B, n, T, d]`` over ``k, v [B, g, L, d]``, each K/V
    head shared by n/g query heads and never copied to them: where every query row sees the same
    keys (one new token, or a mask without a query axis), the n/g heads of a group become rows of one
    query ``[B, g, (n/g)*T, d]``; under a causal pattern without a mask, SDPA's ``enable_gqa`` where
    a fused kernel reads grouped heads (:func:`_gqa_fused`); only a prompt under a full mask (padding)
    or on no such kernel repeats K/V. ``causal``: the queries are
    positions ``0 .. T-1`` (the keys past T, a static cache's empty rows, are not read)."""
    n, g, t = q.shape[1], k.shape[1], q.shape[2]
    if causal and k.shape[2] > t:
        k, v = k[:, :, :t], v[:, :, :t]
    if g == n:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)
    b = q.shape[0]
    if not causal and (mask is None or mask.shape[-2] == 1):
        out = F.scaled_dot_product_attention(q.reshape(b, g, (n // g) * t, q.shape[-1]), k, v, attn_mask=mask,
                                             dropout_p=dropout_p)
        return out.view(b, n, t, v.shape[-1])
    if mask is None and _gqa_fused(q):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=True)
    k, v = k.repeat_interleave(n // g, 1), v.repeat_interleave(n // g, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)


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
        sublayer = Mixing if s["attention"] in MIXING_KINDS else Attention
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

    def forward(self, x, *, mask, padding=None, rope=None, cache=None, layer=0, context=None, context_mask=None):
        x = self._residual(x, self.self_norm, lambda h: self.self_attn(
            h, mask=mask, rope=rope, cache=cache, layer=layer, padding=padding))
        if self.cross_attn is not None:
            x = self._residual(x, self.cross_norm, lambda h: self.cross_attn(h, mask=context_mask, context=context))
        return self._residual(x, self.ffn_norm, self.ffn)


# ------------------------------------------------------------------ masks
def key_padding(attention_mask):
    """A 2D mask (1 = real token) as bool ``[B, S]``; None stays None."""
    return None if attention_mask is None else attention_mask.to(torch.bool)


class KeyMask:
    """What a forward's self-attention layers read of its mask: called with the key length L,
    ``(mask, causal)`` (see :func:`self_attention_mask`); for a decode step whose rows each see one
    run of keys (``runs``, known on the host: :mod:`decode_mhe`), ``ranges(L, B)``, that run as
    FlashAttention's offsets. Each is made once a forward and read by every layer."""

    def __init__(self, build, runs: bool = False) -> None:
        self.build, self.runs, self._ranges = build, runs, {}

    def __call__(self, keys: int):
        return self.build(keys)

    def ranges(self, keys: int, batch: int):
        if keys not in self._ranges:
            self._ranges[keys] = key_range(self.build(keys)[0], batch, keys)
        return self._ranges[keys]


def self_attention_mask(attention_mask, t: int, start, causal: bool, device, runs: bool = False) -> KeyMask:
    """A :class:`KeyMask` giving ``(mask, causal)`` by key length L for T new tokens at positions
    ``start ..`` (``start``: an int, or a static cache's tensor): ``mask`` the boolean
    ``[B|1, 1, T, L]`` (True: attend), causal over absolute positions and with the padding of a 2D
    ``attention_mask`` over the keys it covers, or None where no key is hidden (the whole cache of
    one new token, no padding) or where SDPA's own causal pattern is exact (``causal``: a prompt
    from position 0 without padding; its fast kernels). A 4D mask (what ``generate`` builds for a
    static cache's decode step) is used as it is. A query without any key (a padding query) sees
    all keys, so that its (unused) output stays finite. A 2D mask without padding counts as none
    (one check on the host, outside ``torch.compile``, as transformers makes it). ``runs``: each
    row sees one run of keys (:func:`decode_mhe.left_padded`)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        m4 = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        return KeyMask(lambda keys: (m4[..., :keys], False), runs)
    pad = key_padding(attention_mask)
    if pad is not None and not _compiling() and bool(pad.all()):
        pad = None
    if t > 1 and isinstance(start, torch.Tensor) and not _compiling():
        start = int(start)  # a prompt into a static cache that was reset: one read on the host
    fresh = pad is None and isinstance(start, int)  # the keys are this call's and the cache's, nothing past them
    q = start + torch.arange(t, device=device)  # now: a static cache advances its length in place
    made = {}

    def build(keys: int):
        if fresh and causal and start == 0:
            return None, True
        if fresh and keys == start + t and (t == 1 or not causal):
            return None, False
        if keys not in made:
            m = torch.arange(keys, device=device)[None, :] <= q[:, None] if causal else \
                torch.ones(t, keys, dtype=torch.bool, device=device)
            m = m[None]  # [1, T, L]
            if pad is not None:
                p = pad[:, :keys]
                if p.shape[1] < keys:
                    p = torch.cat([p, p.new_ones(p.shape[0], keys - p.shape[1])], 1)
                m = m & p[:, None, :]
            made[keys] = (m | ~m.any(-1, keepdim=True))[:, None]
        return made[keys], False

    return KeyMask(build, runs)


def padding_mask(attention_mask):
    """``[B, 1, 1, S]`` from a 2D mask, or None."""
    pad = key_padding(attention_mask)
    return None if pad is None else pad[:, None, None, :]


def _cache_arg(kwargs: dict):
    cache, past = kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
    return past if cache is None else cache


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
        self.one_kv = s["attention"] not in MIXING_KINDS and cache_heads(s) == 1  # decode_mhe's split kernel

    def forward(self, input_ids, attention_mask=None, cache=None, position_ids=None):
        t = input_ids.shape[1]
        start = cache.get_seq_length() if cache is not None else 0
        positions = position_ids if position_ids is not None else start + torch.arange(t, device=input_ids.device)
        x = self.embed(input_ids, positions)
        if self.one_kv and cache is not None and not _compiling():  # eager (generate's prompt): look at the mask
            mark_cache(cache, attention_mask, start, t, x.device, x.dtype)
        runs = self.one_kv and marked(cache)
        mask = self_attention_mask(attention_mask, t, start, True, input_ids.device, runs)
        padding = key_padding(attention_mask) if attention_mask is not None and attention_mask.dim() == 2 else None
        rope = self.rope.at(positions, x.dtype) if self.rope is not None else None  # once for every layer
        for i, layer in enumerate(self.layers):
            x = layer(x, mask=mask, padding=padding, rope=rope, cache=cache, layer=i)
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
            x = layer(x, mask=mask, padding=padding)
        return self.final_norm(x) if self.final_norm is not None else x
