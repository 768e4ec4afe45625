"""``mhe bench --sections generate``: what a user's ``model.generate`` call gets, end to end.

gpt2-base with random weights in the bench dtype, greedy, a random prompt and a fixed number
of new tokens (no stop token), timed from the call to its return (prefill included, CUDA
synchronised), after one warm-up call that captures the decode step; median of 3 calls, each
passing the same ``session`` (``model.generator(batch, prompt + new)``), as a caller that
generates repeatedly does (the session keeps the caches and the captured step). Hugging Face's
``GPT2LMHeadModel.generate`` (SDPA attention, its default dynamic cache) on the same sizes
is the peer, in the same run (one call after a short warm-up: it is slow). ``--kernel auto``
(the default) leaves the kernel to ``generate``'s automatic choice, as a user's call does;
each row names the kernel its decode steps ran.
"""

from __future__ import annotations

import torch

from mhe.bench.common import SMOKE_SIZES, timed
from mhe.models import build_model
from mhe.models.decode_step import split_kernel, view_kernels


def generate_settings(batches: str, long: str, small: bool) -> list[tuple[int, int, int]]:
    """(batch, prompt, new tokens): ``batches`` (e.g. ``1,64``) at prompt 256 + 256 new tokens,
    ``long`` (e.g. ``64x4096``) BATCHxCONTEXT runs with 256 new tokens."""
    if small:
        return [(1, 8, 8), (2, 8, 8)]
    out = [(int(b), 256, 256) for b in batches.split(",") if b.strip()]
    for spec in (s for s in long.split(",") if s.strip()):
        b, ctx = (int(x) for x in spec.split("x"))
        out.append((b, ctx - 256, 256))
    return out


def _time(fn, *, cuda: bool, reps: int) -> float:
    """Median seconds of ``fn()`` (the bench's one timer)."""
    return timed(fn, warmup=0, reps=reps, cuda=cuda) / 1000


def _ours(kind, batch, prompt, new, *, dev, dtype, small, kernel, mode, reps):
    opts = {"n_kv_heads": 4} if kind == "gqa" else {}
    configured, requested = split_kernel(kernel)
    over = dict(max_len=prompt + new, attn_options=opts, dropout=0.0, attn_dropout=0.0, attn_kernel=configured)
    if small:
        over.update(SMOKE_SIZES)
    model = build_model("gpt2-base", attention=kind, **over).to(dev, dtype).eval()
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), device=dev)
    session = model.generator(batch, prompt + new, step_mode=mode, kernel=requested)
    model.generate(ids, new, session=session)  # warm-up: captures the step
    sec = _time(lambda: model.generate(ids, new, session=session), cuda=dev.type == "cuda", reps=reps)
    kv, ran = sum(c.nbytes() for c in session.caches), view_kernels(session.view)
    del session
    # the prompt's share: a call for one new token is the prefill alone
    first = model.generator(batch, prompt + 1, step_mode="eager", kernel=requested)
    model.generate(ids, 1, session=first)
    prefill = _time(lambda: model.generate(ids, 1, session=first), cuda=dev.type == "cuda", reps=reps)
    del model, first
    return sec, kv, prefill, ran


def _peer(batch, prompt, new, *, dev, dtype, small, reps):
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    size = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512) if small else {}
    cfg = GPT2Config(n_positions=prompt + new, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **size)
    model = GPT2LMHeadModel(cfg).to(dev, dtype).eval()
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), device=dev)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        sec = _time(lambda: model.generate(ids, **kw), cuda=dev.type == "cuda", reps=1)
    del model
    return sec


def run_generate_section(kinds, settings, *, dev, dtype, small, kernel="auto", graphs=True,
                         peer=True) -> list[dict]:
    """Rows per (batch, prompt, new) of ``settings``: Hugging Face's generate (``peer``), then
    each kind's ``model.generate`` (``graphs``: the decode step as a CUDA graph on a GPU)."""
    cuda = dev.type == "cuda"
    mode = "graph" if cuda and graphs else "eager"
    reps = 1 if small else 3
    rows = []
    for batch, prompt, new in settings:
        if peer:
            sec = _peer(batch, prompt, new, dev=dev, dtype=dtype, small=small, reps=reps)
            if sec is not None:
                rows.append(dict(batch=batch, prompt=prompt, new=new, path="HF GPT2LMHeadModel.generate",
                                 kind="mha", kernel="sdpa (HF)", seconds=sec, kv_bytes=None, kv_mib=None, prefill_ms=None))
        for kind in kinds:
            sec, kv, prefill, ran = _ours(kind, batch, prompt, new, dev=dev, dtype=dtype, small=small,
                                          kernel=kernel, mode=mode, reps=reps)
            rows.append(dict(batch=batch, prompt=prompt, new=new, path=f"model.generate ({mode})", kind=kind,
                             kernel=ran, seconds=sec, kv_bytes=kv, kv_mib=kv / 2**20, prefill_ms=1000 * prefill))
            if cuda:
                torch.cuda.empty_cache()
    for r in rows:
        r["ms_per_token"] = 1000 * r["seconds"] / r["new"]
        r["tokens_per_s"] = r["batch"] * r["new"] / r["seconds"]
    return rows
