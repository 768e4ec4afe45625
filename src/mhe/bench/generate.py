"""``mhe bench --sections generate``: what a user's ``model.generate`` call gets, end to end.

The ``--preset`` model (default gpt2-base) with random weights in the bench dtype, greedy, a
random prompt and a fixed number of new tokens (no stop token), timed from the call to its
return (prefill included, CUDA synchronised), after two warm-up calls (the first compiles and
captures the decode step, the second captures the prompt's prefill or, for a long one, compiles
it: ``Generator.prefill``); median of 3 calls, each passing the same ``session``
(``model.generator(batch, prompt + new)``), as a caller that generates repeatedly does (the
session keeps the caches and the captured step). Each kind's model is built once, for the
longest setting. Hugging Face's ``generate`` (SDPA attention, its default dynamic cache) on the
same sizes is the peer, in the same run, after every ``model.generate`` row (it is slow: one
call after a short warm-up, and with ``peer_tokens`` only that many of its new tokens timed, the
rest counted at their rate):
``GPT2LMHeadModel`` for the GPT-2 presets, ``LlamaForCausalLM`` with the preset's own K/V
grouping for the Llama-style ones. ``--kernel auto``
(the default) leaves the kernel to ``generate``'s automatic choice, as a user's call does;
each row names the kernel its decode steps ran.
"""

from __future__ import annotations

import time

import torch

from mhe.attention.kernels import split_kernel, view_kernels
from mhe.bench.common import bench_config, timed
from mhe.models import build_model
from mhe.models import preset as model_preset


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


def _ours(model, batch, prompt, new, *, dev, kernel, mode, reps):
    _, requested = split_kernel(kernel)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), device=dev)
    session = model.generator(batch, prompt + new, step_mode=mode, kernel=requested)
    # warm-up: the first call compiles and captures the step, the second captures or compiles the prefill
    for _ in range(2):
        model.generate(ids, new, session=session)
    sec = _time(lambda: model.generate(ids, new, session=session), cuda=dev.type == "cuda", reps=reps)
    ran = session.plan.kernel if session.plan is not None else view_kernels(session.view)  # no plan: the configured
    kv, mode = sum(c.nbytes() for c in session.caches), session.step_mode_ran()
    # the prompt's share: a call for one new token is the prefill alone, as the session runs it
    # (captured, or compiled for a long prompt, from the shape's second call: the timed calls above)
    prefill = _time(lambda: model.generate(ids, 1, session=session), cuda=dev.type == "cuda", reps=reps)
    return sec, kv, prefill, ran, mode


def _our_model(preset, kind, *, small, kernel, max_len):
    cfg = bench_config(preset, kind, small=small, gqa_heads=4, max_len=max_len, dropout=0.0, attn_dropout=0.0,
                       attn_kernel=split_kernel(kernel)[0])
    return build_model(cfg)


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


def _peer(model, batch, prompt, new, *, dev, tokens):
    """Seconds of Hugging Face's ``generate`` for ``new`` tokens and how many it timed: every one
    (``tokens`` 0 or at least ``new``; one call), or a prefill-only call and one of ``tokens``
    new tokens, the rest counted at their per-token rate (its steps are host-bound; the cache that
    grows makes a later step no cheaper, so the estimate never favours ``model.generate``)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0, eos_token_id=None)

    def call(n: int) -> float:
        return _time(lambda: model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw), cuda=dev.type == "cuda",
                     reps=1)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        if not tokens or tokens >= new:
            return call(new), new
        first, part = call(1), call(tokens)
    return first + (part - first) * (new - 1) / (tokens - 1), tokens


def run_generate_section(kinds, settings, *, dev, dtype, small, kernel="auto", graphs=True, peer=True,
                         preset="gpt2-base", peer_tokens=0, deadline=0.0) -> tuple[list[dict], list[str]]:
    """Rows per (batch, prompt, new) of ``settings``: each kind's ``model.generate`` of ``preset``
    (``graphs``: the step mode a default call takes, ``auto``: on a GPU the compiled step
    replayed as a CUDA graph; else eager steps; each kind's model built once), then
    Hugging Face's generate (``peer``; ``peer_tokens``: see :func:`_peer`). No row starts after
    ``deadline`` seconds (0: no limit); the rows skipped are returned beside the measured ones."""
    mode = "auto" if graphs else "eager"
    reps, longest = 1 if small else 3, max(p + n for _, p, n in settings)
    jobs = [(s, k) for s in settings for k in kinds] + ([(s, None) for s in settings] if peer else [])
    rows, skipped, models, start = [], [], {}, time.perf_counter()
    for (batch, prompt, new), kind in jobs:
        if deadline and time.perf_counter() - start > deadline:
            skipped.append(f"{kind or 'HF'} {batch} x {prompt}+{new}")
            continue
        if kind not in models:  # built once, for the longest setting
            models[kind] = (_peer_model(preset, longest, small) if kind is None else
                            _our_model(preset, kind, small=small, kernel=kernel, max_len=longest))
            models[kind] = models[kind] if models[kind] is None else models[kind].to(dev, dtype).eval()
        row = dict(batch=batch, prompt=prompt, new=new)
        if kind is None and models[None] is not None:
            sec, timed_new = _peer(models[None], batch, prompt, new, dev=dev, tokens=peer_tokens)
            rotary = model_preset(preset).positions == "rotary"
            rows.append(dict(row, kernel="sdpa (HF)", seconds=sec, kv_bytes=None, kv_mib=None, prefill_ms=None,
                             path=f"HF {'LlamaForCausalLM' if rotary else 'GPT2LMHeadModel'}.generate",
                             kind=model_preset(preset).attention, timed_new=timed_new))
        elif kind is not None:
            sec, kv, prefill, ran, ran_mode = _ours(models[kind], batch, prompt, new, dev=dev, kernel=kernel, mode=mode,
                                                    reps=reps)
            rows.append(dict(row, path=f"model.generate ({ran_mode})", kind=kind, kernel=ran, seconds=sec, kv_bytes=kv,
                             kv_mib=kv / 2**20, prefill_ms=1000 * prefill, timed_new=new))
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for r in rows:
        r["ms_per_token"] = 1000 * r["seconds"] / r["new"]
        r["tokens_per_s"] = r["batch"] * r["new"] / r["seconds"]
    order = {s: i for i, s in enumerate(settings)}
    rows.sort(key=lambda r: (order[(r["batch"], r["prompt"], r["new"])], not r["path"].startswith("HF")))
    return rows, skipped
