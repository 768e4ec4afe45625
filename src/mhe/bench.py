"""``mhe bench``: every attention kind side by side on the current device, one table.

Sections (each can be chosen with ``--sections``):

* ``attn``: one attention sublayer, forward and forward+backward (GPT-2 sizes:
  m=768, 12 heads of 64, B=16, T=1024, causal, bf16);
* ``train``: end-to-end training step of the gpt2-base and bert-base presets at
  sequence length 512 (bf16 autocast, optional torch.compile): tokens/s, MFU,
  peak memory;
* ``decode``: one generation step of gpt2-base against a filled KV cache at
  (batch 64, context 4096) and (batch 1, context 1024): tokens/s and KV bytes;
* ``generate``: the user's call, ``model.generate`` end to end (prompt + new tokens), with
  Hugging Face GPT-2's ``generate`` as the peer (``mhe.bench_generate``).

``--kernel`` picks the attention kernel (``mhe.attention.kernels.KERNELS``) through the
model configuration; nothing global is switched. ``auto`` (the default) is ``sdpa``, except
that the decode and generate sections decode as a user's ``generate`` call does: on a GPU,
sublayers with a one-K/V-head cache use ``flash-decode`` (``decode_step.decode_kernel``);
every decode row names the kernel that ran.

Timing: warm-up first, CUDA events around each call, median of the repeats.
On a CPU it runs a tiny smoke configuration so CI can check that it runs.
"""

from __future__ import annotations

import statistics
import time

import torch

from mhe.attention import build_attention
from mhe.attention.folding import fold_mhe, fold_model
from mhe.models import build_model
from mhe.models import preset as model_preset
from mhe.models.decode_step import decode_kernel, inference_view, split_kernel, view_kernels


BENCH_KINDS = ("mha", "mqa", "gqa", "sha", "skv", "el-att", "mhe-add", "mhe-mul")
# Dense bf16 tensor-core peak, from the vendors' datasheets (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def model_shape(cfg) -> str:
    """What was measured, e.g. ``12L x 768 (12 heads), vocab 50304``: smoke sizes shrink every
    preset, so a row's preset name alone would not say."""
    return f"{cfg.n_layers}L x {cfg.d_model} ({cfg.n_heads} heads), vocab {cfg.vocab_size}"


def device_peak(name: str) -> float | None:
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None


SMALL_SIZES = dict(d_model=64, n_heads=4, n_layers=2, d_ff=128, vocab_size=512)


def bench_config(preset: str, kind: str, *, small: bool, gqa_heads: int | None = None, **overrides):
    """The model a bench row measures: ``preset`` with attention ``kind`` and ``overrides``. GQA keeps
    the preset's own grouping where the preset is grouped (llama-135m: 3 K/V heads), else
    ``gqa_heads`` or the default group count (:func:`mhe.attention.multi_head.default_kv_heads`);
    ``small`` shrinks every model to :data:`SMALL_SIZES` (GQA then 2 K/V heads)."""
    cfg = model_preset(preset)
    if kind == "gqa" and (small or (gqa_heads and cfg.attention != "gqa")):
        overrides["attn_options"] = {"n_kv_heads": 2 if small else gqa_heads}
    return cfg.replace(attention=kind, **{**overrides, **(SMALL_SIZES if small else {})})


def timed(fn, *, warmup: int, reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_timed(fn, *, warmup: int, reps: int) -> float:
    """Median milliseconds of replaying ``fn`` captured as one CUDA graph (no launch overhead)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return timed(graph.replay, warmup=warmup, reps=reps, cuda=True)


def _variants(kinds):
    out = []
    for k in kinds:
        opts = {"n_kv_heads": 4} if k == "gqa" else {}
        out.append((k, k, opts))
        if k == "mhe-mul":
            out.append(("mhe-mul (act. fold)", k, {"query_fold": "activation"}))
            out.append(("mhe-mul (reference)", k, {"impl": "reference"}))
        if k == "mhe-add":
            out.append(("mhe-add (reference)", k, {"impl": "reference"}))
    return out


def bench_attention(kinds, *, dev, dtype, B, T, m, n, warmup, reps, compile_model=False,
                    kernel="sdpa") -> list[dict]:
    """Each variant compiled on its own (dynamo reset between them, so eight variants never
    reach dynamo's recompile limit); ``graphs`` counts the graphs dynamo built for it
    (1 = no recompilation; fwd and fwd+bwd share one graph)."""
    cuda = dev.type == "cuda"
    rows = []
    for label, kind, opts in _variants(kinds):
        mod = build_attention(kind, d_model=m, n_heads=n, causal=True, kernel=kernel, **opts).to(dev, dtype)
        if compile_model:
            torch._dynamo.reset()
            torch._dynamo.utils.counters.clear()
            mod = torch.compile(mod)
        x = torch.randn(B, T, m, device=dev, dtype=dtype, requires_grad=True)
        g = torch.randn(B, T, m, device=dev, dtype=dtype)

        def fwd():
            with torch.no_grad():
                mod(x)

        def fwd_bwd():
            mod(x).backward(g)

        row = {"kind": label, "fwd_ms": timed(fwd, warmup=warmup, reps=reps, cuda=cuda),
               "fwd_bwd_ms": timed(fwd_bwd, warmup=warmup, reps=reps, cuda=cuda)}
        if compile_model:
            row["graphs"] = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
        rows.append(row)
        del mod, x, g
    return rows


def bench_decode_attention(kinds, settings, *, dev, dtype, m, n, warmup, reps, graphs=False,
                           kernel="auto") -> list[dict]:
    """One attention sublayer decoding one token against a filled cache (MHE folded to MQA)."""
    cuda = dev.type == "cuda"
    configured, requested = split_kernel(kernel)
    rows = []
    for batch, ctx in settings:
        for kind in kinds:
            opts = {}  # gqa: the one default group count (mhe.attention.multi_head.default_kv_heads)
            mod = build_attention(kind, d_model=m, n_heads=n, causal=True, kernel=configured, **opts).to(dev, dtype).eval()
            if kind.startswith("mhe-"):
                mod = fold_mhe(mod)
            mod = inference_view(mod, lambda a: decode_kernel(a, dev, requested))
            cache = mod.new_cache(batch, ctx + 1)
            cache.k.normal_()
            cache.v.normal_()
            x = torch.randn(batch, 1, m, device=dev, dtype=dtype)

            def step():
                cache.pos = ctx
                with torch.no_grad():
                    mod(x, cache=cache)

            ms = graph_timed(step, warmup=warmup, reps=reps) if graphs else timed(step, warmup=warmup, reps=reps, cuda=cuda)
            kv = cache.nbytes() * ctx // (ctx + 1)  # the filled part (the buffer holds one more slot)
            rows.append({"batch": batch, "context": ctx, "kind": kind, "kernel": mod.cfg.kernel, "step_ms": ms,
                         "kv_cache_bytes": kv, "kv_cache_mib": kv / 2**20, "cache_gb_per_s": kv / ms / 1e6})
    return rows


def bench_training(kinds, presets, *, dev, B, T, steps, warmup, compile_model, small, pad_vocab=True) -> list[dict]:
    cuda = dev.type == "cuda"
    peak = device_peak(torch.cuda.get_device_name(dev)) if cuda else None
    rows = []
    for preset in presets:
        for kind in kinds:
            overrides = dict(max_len=max(T, 512))
            if pad_vocab:  # a multiple of 128 keeps the output GEMM on full tiles (50257 -> 50304)
                overrides["vocab_size"] = -(-model_preset(preset).vocab_size // 128) * 128
            model = build_model(bench_config(preset, kind, small=small, **overrides)).to(dev)
            cfg = model.cfg
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
            step_fn = model if not compile_model else torch.compile(model)
            ids = torch.randint(0, cfg.vocab_size, (B, T), device=dev)
            labels = ids if cfg.arch == "decoder" else torch.where(torch.rand(B, T, device=dev) < 0.15, ids, -100)

            def step():
                with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                    loss = step_fn(ids, labels=labels).loss
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            ms = timed(step, warmup=warmup, reps=steps, cuda=cuda)
            n_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            # model FLOPs per token: 6N for the weights plus 12 L T m for attention scores
            # (Chowdhery et al. 2022, Appendix B), counted with causal masking ignored
            flops_tok = 6 * n_params + 12 * cfg.n_layers * T * cfg.n_heads * cfg.resolved_head_dim
            tok_s = B * T / (ms / 1000)
            rows.append({"preset": preset, "kind": kind, "shape": model_shape(cfg), "step_ms": ms, "tokens_per_s": tok_s,
                         "mfu": (flops_tok * tok_s / peak) if peak else None,
                         "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30 if cuda else None})
            del model, opt, step_fn
            if cuda:
                torch.cuda.empty_cache()
    return rows


def bench_decode(kinds, settings, *, dev, dtype, warmup, reps, small, graphs=False, kernel="auto",
                 preset="gpt2-base") -> list[dict]:
    cuda = dev.type == "cuda"
    configured, requested = split_kernel(kernel)
    rows = []
    for batch, ctx in settings:
        for kind in kinds:
            cfg = bench_config(preset, kind, small=small, max_len=ctx + 1, dropout=0.0, attn_dropout=0.0,
                               attn_kernel=configured)
            model = build_model(cfg).to(dev, dtype).eval()
            if kind.startswith("mhe-"):
                fold_model(model)  # decode exactly as a multi-query model
            model = inference_view(model, lambda a: decode_kernel(a, dev, requested))
            caches = model.new_caches(batch, ctx + 1)
            for c in caches:  # a filled cache of ctx positions
                c.k.normal_()
                c.v.normal_()
            tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=dev)

            def step():
                for c in caches:
                    c.pos = ctx
                with torch.no_grad():
                    model(tok, caches=caches)

            ms = graph_timed(step, warmup=warmup, reps=reps) if graphs else timed(step, warmup=warmup, reps=reps, cuda=cuda)
            layer = caches[0].nbytes() * ctx // (ctx + 1)  # the filled part of each layer's cache
            total = sum(c.nbytes() for c in caches) * ctx // (ctx + 1)
            rows.append({"batch": batch, "context": ctx, "kind": kind, "kernel": view_kernels(model),
                         "shape": model_shape(model.cfg), "step_ms": ms, "tokens_per_s": batch / (ms / 1000),
                         "kv_cache_bytes_per_layer": layer, "kv_cache_bytes_total": total,
                         "kv_cache_mib_per_layer": layer / 2**20, "kv_cache_mib_total": total / 2**20})
            del model, caches
            if cuda:
                torch.cuda.empty_cache()
    return rows
