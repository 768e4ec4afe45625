"""``mhe bench --sections generate``: what a user's ``model.generate`` call gets, end to end.

The ``--preset`` model (default gpt2-base) with random weights in the bench dtype, greedy, a
random prompt and a fixed number of new tokens (no stop token), timed from the call to its
return (prefill included, CUDA synchronised), after one warm-up call that captures the decode
step; median of 3 calls, each passing the same ``session`` (``model.generator(batch, prompt +
new)``), as a caller that generates repeatedly does (the session keeps the caches and the
captured step). Hugging Face's ``generate`` (SDPA attention, its default dynamic cache) on the
same sizes is the peer, in the same run (one call after a short warm-up: it is slow):
``GPT2LMHeadModel`` for the GPT-2 presets, ``LlamaForCausalLM`` with the preset's own K/V
grouping for the Llama-style ones. ``--kernel auto``
(the default) leaves the kernel to ``generate``'s automatic choice, as a user's call does;
each row names the kernel its decode steps ran.
"""

from __future__ import annotations

import torch

from mhe.bench.common import bench_config, timed
from mhe.models import build_model
from mhe.models import preset as model_preset
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


def _ours(kind, batch, prompt, new, *, dev, dtype, small, kernel, mode, reps, preset="gpt2-base"):
    configured, requested = split_kernel(kernel)
    cfg = bench_config(preset, kind, small=small, gqa_heads=4, max_len=prompt + new, dropout=0.0, attn_dropout=0.0,
                       attn_kernel=configured)
    model = build_model(cfg).to(dev, dtype).eval()
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


def _peer_model(preset: str, length: int, small: bool):
    """Hugging Face's model of the preset's shape (random weights), or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    if model_preset(preset).positions == "rotary":
        from mhe.hf.llama import llama_hf_config

        cfg = bench_config(preset, model_preset(preset).attention, small=small, max_len=length)
        return transformers.LlamaForCausalLM(llama_hf_config(cfg, "LlamaForCausalLM"))
    size = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=512) if small else {}
    cfg = transformers.GPT2Config(n_positions=length, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0, **size)
    return transformers.GPT2LMHeadModel(cfg)


def _peer(batch, prompt, new, *, dev, dtype, small, reps, preset="gpt2-base"):
    model = _peer_model(preset, prompt + new, small)
    if model is None:
        return None
    model = model.to(dev, dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=dev)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})  # warm-up
        sec = _time(lambda: model.generate(ids, **kw), cuda=dev.type == "cuda", reps=1)
    del model
    return sec


def run_generate_section(kinds, settings, *, dev, dtype, small, kernel="auto", graphs=True,
                         peer=True, preset="gpt2-base") -> list[dict]:
    """Rows per (batch, prompt, new) of ``settings``: Hugging Face's generate (``peer``), then
    each kind's ``model.generate`` (``graphs``: the decode step as a CUDA graph on a GPU), of
    ``preset``."""
    cuda = dev.type == "cuda"
    mode = "graph" if cuda and graphs else "eager"
    reps = 1 if small else 3
    rows = []
    for batch, prompt, new in settings:
        if peer:
            sec = _peer(batch, prompt, new, dev=dev, dtype=dtype, small=small, reps=reps, preset=preset)
            if sec is not None:
                rotary = model_preset(preset).positions == "rotary"
                rows.append(dict(batch=batch, prompt=prompt, new=new, kernel="sdpa (HF)", seconds=sec, kv_bytes=None,
                                 path=f"HF {'LlamaForCausalLM' if rotary else 'GPT2LMHeadModel'}.generate",
                                 kind=model_preset(preset).attention, kv_mib=None, prefill_ms=None))
        for kind in kinds:
            sec, kv, prefill, ran = _ours(kind, batch, prompt, new, dev=dev, dtype=dtype, small=small,
                                          kernel=kernel, mode=mode, reps=reps, preset=preset)
            rows.append(dict(batch=batch, prompt=prompt, new=new, path=f"model.generate ({mode})", kind=kind,
                             kernel=ran, seconds=sec, kv_bytes=kv, kv_mib=kv / 2**20, prefill_ms=1000 * prefill))
            if cuda:
                torch.cuda.empty_cache()
    for r in rows:
        r["ms_per_token"] = 1000 * r["seconds"] / r["new"]
        r["tokens_per_s"] = r["batch"] * r["new"] / r["seconds"]
    return rows
