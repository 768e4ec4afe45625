"""Slow, literal implementations of the paper's equations, for comparison in tests.

Everything loops over heads and writes the softmax out by hand (Eq. 3) with a
hand-built causal mask; weights are read from the module under test.
"""

from __future__ import annotations

import functools
import math

import torch


def softmax_attention(q, k, v, *, causal=False, key_mask=None, offset=0):
    """One head: q [B, T, d], k, v [B, S, d] -> [B, T, d]."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    t, s = q.shape[1], k.shape[1]
    allowed = torch.ones(q.shape[0], t, s, dtype=torch.bool)
    if causal:
        for i in range(t):
            for j in range(s):
                if j > i + offset:
                    allowed[:, i, j] = False
    if key_mask is not None:
        allowed &= key_mask[:, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@functools.lru_cache(maxsize=None)
def rope_cos_sin(pos: int, i: int, width: int, base: float) -> tuple[float, float]:
    """cos and sin of theta_i at ``pos`` for pair ``i`` of a rotary width ``width``, rounded as
    Llama's code rounds them: every step in float32 (2i / r, base^that, its inverse, times the
    position, then cos and sin)."""
    f32 = torch.float32
    exponent = torch.tensor(2 * i, dtype=f32) / width
    inv = 1.0 / (torch.tensor(float(base), dtype=f32) ** exponent)
    theta = torch.tensor(float(pos), dtype=f32) * inv
    return float(torch.cos(theta)), float(torch.sin(theta))


def rope_reference(x, positions, *, base, fraction=1.0):
    """RoPE pair by pair (Su et al. 2021, Eq. 34, half-split pairs (i, i + r/2) as in Llama):
    x [B, T, d] (one head), positions [B, T] -> [B, T, d]. The first r = int(fraction * d)
    dimensions are rotated, the rest pass through (:func:`rope_cos_sin` for the constants)."""
    d = x.shape[-1]
    r = int(d * fraction)
    h = r // 2
    first, second = [], []
    for i in range(h):
        cs = [[rope_cos_sin(int(p), i, r, base) for p in row] for row in positions.tolist()]
        c = torch.tensor([[v[0] for v in row] for row in cs], dtype=x.dtype)  # [B, T]
        s = torch.tensor([[v[1] for v in row] for row in cs], dtype=x.dtype)
        a, z = x[..., i], x[..., i + h]
        first.append(a * c - z * s)
        second.append(z * c + a * s)
    return torch.cat([torch.stack(first, -1), torch.stack(second, -1), x[..., r:]], -1)


def _lin(x, layer, rows=None):
    w = layer.weight if rows is None else layer.weight[rows]
    b = layer.bias if (layer.bias is None or rows is None) else layer.bias[rows]
    return x @ w.T + (0 if b is None else b)


def reference_forward(mod, x, *, context=None, mask=None, positions=None):
    """The kind's equations head by head; returns [B, T, m]. With rotary positions (the
    module's ``rotary``; ``positions`` [B, T], default 0 .. T-1) every head's query and key are
    rotated by :func:`rope_reference`; MHE's head embeddings act after the rotation
    (``rope_order="rope-then-psi"``) or before it (``"psi-then-rope"``)."""
    kind = mod.kind
    cfg = mod.cfg
    n, d, m = cfg.n_heads, cfg.head_dim, cfg.d_model
    src = x if context is None else context
    causal = cfg.causal and context is None
    heads = []
    rot = getattr(mod, "rotary", None)
    if rot is None or context is not None:
        rope = _no_rope
    else:
        if positions is None:
            positions = torch.arange(x.shape[1]).expand(x.shape[0], -1)
        rope = _rope_at(positions, rot.base, rot.fraction)
    if kind in ("mha", "gqa", "mqa", "skv", "el-att"):
        g = {"mha": n, "gqa": mod.n_kv_heads, "mqa": 1, "skv": n, "el-att": n}[kind]
        for i in range(n):
            qi = _lin(x, mod.q_proj, slice(i * d, (i + 1) * d))
            j = i // (n // g)
            if kind == "skv":
                ki = vi = _lin(src, mod.kv_proj, slice(j * d, (j + 1) * d))
            elif kind == "el-att":
                ki = vi = src[..., j * d:(j + 1) * d]
            else:
                ki = _lin(src, mod.k_proj, slice(j * d, (j + 1) * d))
                vi = _lin(src, mod.v_proj, slice(j * d, (j + 1) * d))
            heads.append(softmax_attention(rope(qi), rope(ki), vi, causal=causal, key_mask=mask))
        return _lin(torch.cat(heads, -1), mod.out_proj)
    if kind == "sha":
        h = softmax_attention(rope(_lin(x, mod.q_proj)), rope(_lin(src, mod.k_proj)), _lin(src, mod.v_proj),
                              causal=causal, key_mask=mask)
        return _lin(torch.cat([h] * n, -1), mod.out_proj)  # one head tiled n times
    if kind in ("mhe-add", "mhe-mul"):
        e = mod.head_embed
        q, k, v = _lin(x, mod.q_proj), _lin(src, mod.k_proj), _lin(src, mod.v_proj)  # Eq. 4
        psi = (lambda a, b: a * (b + 1)) if kind == "mhe-mul" else (lambda a, b: a + b)  # section 3.4
        psi_first = cfg.options.rope_order == "psi-then-rope"
        for i in range(n):  # Eqs. 5-6
            if psi_first:
                qi, ki = rope(psi(q, e[0, i])), rope(psi(k, e[1, i]))
            else:
                qi, ki = psi(rope(q), e[0, i]), psi(rope(k), e[1, i])
            heads.append(softmax_attention(qi, ki, psi(v, e[2, i]), causal=causal, key_mask=mask))
        return _lin(torch.cat(heads, -1), mod.out_proj)
    if kind == "fnet":
        xm = x if mask is None else x * mask[..., None]
        out = torch.zeros_like(xm)
        t = xm.shape[1]
        for b in range(xm.shape[0]):  # DFT written out along both axes
            it, im = torch.arange(t, dtype=torch.float64), torch.arange(m, dtype=torch.float64)
            fs = torch.exp(-2j * math.pi * torch.outer(it, it) / t)
            fm = torch.exp(-2j * math.pi * torch.outer(im, im) / m)
            out[b] = (fs @ xm[b].to(torch.complex128) @ fm).real.to(x.dtype)
        return out
    if kind == "linear":
        xm = x if mask is None else x * mask[..., None]
        t = x.shape[1]
        w = mod.seq_mix[:t, :t]
        if cfg.causal:
            w = torch.tril(w)
        return _lin(w @ xm, mod.hidden_mix)
    raise KeyError(kind)


def _no_rope(t):
    return t


def _rope_at(positions, base, fraction):
    return lambda t: rope_reference(t, positions, base=base, fraction=fraction)


def rms_norm_reference(x, gain, eps):
    """Zhang & Sennrich (2019), Eq. 4, written out: x_i / sqrt(mean_j x_j^2 + eps) * g_i."""
    ms = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return x / torch.sqrt(ms + eps) * gain


def swiglu_reference(x, gate, up, down):
    """Shazeer (2020), Eq. 6 without biases: (Swish_1(x W) * (x V)) W_2, Swish_1(z) = z / (1 + e^-z)."""
    a, b = x @ gate.T, x @ up.T
    return (a / (1 + torch.exp(-a)) * b) @ down.T


# --- decoding oracles: every step re-reads the whole sequence, no cache ---------------------------
@torch.no_grad()
def generate_uncached(model, input_ids, max_new_tokens, *, attention_mask=None, return_logits=False):
    """Greedy continuation of left-padded prompts ``[B, P]``, re-running the whole sequence each
    step (positions counted from each row's first real token); the tokens ``[B, P + n]`` and,
    with ``return_logits``, the logits each new token was chosen from ``[B, n, V]``."""
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    seq = input_ids
    seen = []
    for _ in range(max_new_tokens):
        positions = (mask.long().cumsum(1) - 1).clamp_min(0)
        logits = model(seq, attention_mask=mask, position_ids=positions).logits[:, -1]
        seen.append(logits)
        tok = logits.argmax(-1)[:, None]
        seq = torch.cat([seq, tok], 1)
        mask = torch.cat([mask, torch.ones_like(tok, dtype=torch.bool)], 1)
    return (seq, torch.stack(seen, 1)) if return_logits else seq


@torch.no_grad()
def seq2seq_greedy(model, src_ids, src_mask=None, *, bos_id, eos_id, max_len, use_cache=True):
    """Greedy decoding of an encoder-decoder, one token at a time through its caches
    (``use_cache``) or re-reading the whole prefix; ``[B, <= max_len]`` tokens from ``bos_id``."""
    memory = model.encode(src_ids, src_mask)
    b = src_ids.shape[0]
    out = torch.full((b, 1), bos_id, dtype=torch.long, device=src_ids.device)
    caches = model.new_caches(b, max_len) if use_cache else None
    done = torch.zeros(b, dtype=torch.bool, device=src_ids.device)
    for _ in range(max_len - 1):
        step = out[:, -1:] if use_cache else out
        nxt = model.decode(step, memory, src_mask, caches=caches)[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
        out = torch.cat([out, nxt[:, None]], dim=1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    return out


@torch.no_grad()
def beam_search_uncached(model, src, src_mask=None, *, bos_id, eos_id, beam, max_len, alpha=0.6,
                         return_scores=False):
    """Beam search re-reading the whole prefix each step: the same ranking as
    ``mhe.generation.beam.beam_search`` (finished hypotheses only extend with EOS at no cost,
    top-k over beam x vocabulary), the final choice made one hypothesis at a time by
    :func:`best_by_length_penalty`."""
    b, dev = src.shape[0], src.device
    src_mask = torch.ones_like(src, dtype=torch.bool) if src_mask is None else src_mask
    memory = model.encode(src, src_mask).repeat_interleave(beam, 0)  # [B*k, S, m]
    smask = src_mask.repeat_interleave(beam, 0)
    tokens = torch.full((b * beam, 1), bos_id, dtype=torch.long, device=dev)
    scores = torch.zeros(b, beam, device=dev)
    scores[:, 1:] = float("-inf")
    finished = torch.zeros(b * beam, dtype=torch.bool, device=dev)
    base = (torch.arange(b, device=dev) * beam)[:, None]
    for _ in range(max_len - 1):
        logp = torch.log_softmax(model.decode(tokens, memory, smask)[:, -1].float(), -1)  # [B*k, V]
        vocab = logp.shape[-1]
        eos_only = torch.full_like(logp[0], float("-inf"))
        eos_only[eos_id] = 0.0
        logp = torch.where(finished[:, None], eos_only, logp)
        scores, idx = (scores.reshape(-1, 1) + logp).view(b, beam * vocab).topk(beam, dim=1)  # [B, k]
        sel = (base + idx // vocab).view(-1)
        tok = (idx % vocab).view(-1, 1)
        tokens = torch.cat([tokens[sel], tok], 1)
        finished = finished[sel] | (tok.view(-1) == eos_id)
        if bool(finished.all()):
            break
    out, best = best_by_length_penalty(tokens, scores, eos_id=eos_id, alpha=alpha)
    return (out, best) if return_scores else out


def gnmt_length_penalty(length: int, alpha: float) -> torch.Tensor:
    """Wu et al. (2016), Eq. 14: lp(Y) = (5 + |Y|)^alpha / (5 + 1)^alpha, in float32 (the
    search's scores are float32)."""
    return ((5.0 + torch.tensor(float(length))) / 6.0) ** alpha


def best_by_length_penalty(tokens, scores, *, eos_id, alpha):
    """Each source's best of its ``k`` hypotheses (``tokens [B*k, L]`` from BOS, ``scores [B, k]``
    summed log-probabilities), one hypothesis at a time: |Y| counts the tokens after BOS up to and
    including the first EOS (all of them when none ends), the score divided by
    :func:`gnmt_length_penalty`, the first of equal scores. Rows: BOS, the hypothesis up to its
    EOS, then EOS up to the longest row; with the chosen scores ``[B]``."""
    b, k = scores.shape
    rows, best = [], []
    for i in range(b):
        chosen, value = None, None
        for j in range(k):
            hyp = tokens[i * k + j].tolist()
            body = hyp[1:]
            n = body.index(eos_id) + 1 if eos_id in body else len(body)
            v = scores[i, j] / gnmt_length_penalty(n, alpha)
            if value is None or bool(v > value):
                chosen, value = hyp[:n + 1], v
        rows.append(chosen)
        best.append(value)
    width = max(len(r) for r in rows)
    out = torch.tensor([r + [eos_id] * (width - len(r)) for r in rows], dtype=tokens.dtype, device=tokens.device)
    return out, torch.stack(best)
