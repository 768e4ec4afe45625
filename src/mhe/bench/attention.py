"""``mhe bench`` sections ``attn`` and ``decode``: one attention sublayer, forward and
forward+backward (GPT-2 sizes: m=768, 12 heads of 64, B=16, T=1024, causal, bf16), and one
generation step against a filled KV cache, of one sublayer and of gpt2-base, at (batch 64,
context 4096) and (batch 1, context 1024): tokens/s and KV bytes.

``kernel`` picks the attention kernel (``mhe.attention.kernels.KERNELS``) through the model
configuration; nothing global is switched. ``auto`` is ``sdpa``, except that the decode
sections decode as a user's ``generate`` call does: on a GPU, sublayers with a one-K/V-head
cache use ``flash-decode`` (``attention.kernels.decode_plan``, passed to each call); every decode row names the kernel
that ran.
"""

from __future__ import annotations

import torch

from mhe.attention import attention_spec, build_attention, masks
from mhe.attention.folding import fold_mhe, fold_model
from mhe.attention.kernels import decode_plan, split_kernel
from mhe.bench.common import bench_config, model_shape, timed
from mhe.models import build_model


def _variants(kinds):
    out = []
    for k in kinds:
        spec = attention_spec(k)
        opts = {"n_kv_heads": 4} if spec.grouped else {}
        out.append((spec.name, spec, opts))
        if spec.psi == "mul":  # the weight fold (default) and the activation fold of the query factors
            out.append((f"{spec.name} (act. fold)", spec, {"query_fold": "activation"}))
        if spec.is_mhe:
            out.append((f"{spec.name} (reference)", spec, {"impl": "reference"}))
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
    rows, specs = [], [attention_spec(k) for k in kinds]  # each kind looked up once (specs pass as they are)
    for batch, ctx in settings:
        for spec in specs:
            opts = {}  # gqa: the one default group count (mhe.attention.multi_head.default_kv_heads)
            mod = build_attention(spec, d_model=m, n_heads=n, causal=True, kernel=configured, **opts)
            mod = mod.to(dev, dtype).eval()
            if spec.folds:
                mod = fold_mhe(mod)
            plan = decode_plan(mod, dev, dtype, requested, batch=batch, positions=ctx + 1)
            cache = mod.new_cache(batch, ctx + 1)
            cache.k.normal_()
            cache.v.normal_()
            x = torch.randn(batch, 1, m, device=dev, dtype=dtype)
            # what a model builds once per forward for all its layers: the new token's position and mask
            at = torch.tensor(ctx, device=dev)
            pos, mask = at[None], masks.self_attention_mask(x, None, start=at, keys=ctx + 1, plan=plan)

            def step():
                cache.index.fill_(ctx)
                with torch.no_grad():
                    mod(x, positions=pos, mask=mask, cache=cache, plan=plan)

            ms = timed(step, warmup=warmup, reps=reps, cuda=cuda, graph=graphs)
            kv = cache.nbytes() * ctx // (ctx + 1)  # the filled part (the buffer holds one more slot)
            rows.append({"batch": batch, "context": ctx, "kind": spec.name, "kernel": plan.kernel, "step_ms": ms,
                         "kv_cache_bytes": kv, "kv_cache_mib": kv / 2**20, "cache_gb_per_s": kv / ms / 1e6})
    return rows


def bench_decode(kinds, settings, *, dev, dtype, warmup, reps, small, graphs=False, kernel="auto",
                 preset="gpt2-base") -> list[dict]:
    cuda = dev.type == "cuda"
    configured, requested = split_kernel(kernel)
    rows, specs = [], [attention_spec(k) for k in kinds]
    for batch, ctx in settings:
        for spec in specs:
            cfg = bench_config(preset, spec, small=small, max_len=ctx + 1, dropout=0.0, attn_dropout=0.0,
                               attn_kernel=configured)
            model = build_model(cfg).to(dev, dtype).eval()
            if spec.folds:
                fold_model(model)  # decode exactly as a multi-query model (under RoPE: as it is, one head)
            plan = decode_plan(model, dev, dtype, requested, batch=batch, positions=ctx + 1)
            caches = model.new_caches(batch, ctx + 1)
            for c in caches:  # a filled cache of ctx positions
                c.k.normal_()
                c.v.normal_()
            tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=dev)

            def step():
                caches[0].index.fill_(ctx)  # the position every layer's cache shares
                with torch.no_grad():
                    model(tok, caches=caches, plan=plan)

            ms = timed(step, warmup=warmup, reps=reps, cuda=cuda, graph=graphs)
            layer = caches[0].nbytes() * ctx // (ctx + 1)  # the filled part of each layer's cache
            total = sum(c.nbytes() for c in caches) * ctx // (ctx + 1)
            rows.append({"batch": batch, "context": ctx, "kind": spec.name, "kernel": plan.kernel,
                         "shape": model_shape(model.cfg), "step_ms": ms, "tokens_per_s": batch / (ms / 1000),
                         "kv_cache_bytes_per_layer": layer, "kv_cache_bytes_total": total,
                         "kv_cache_mib_per_layer": layer / 2**20, "kv_cache_mib_total": total / 2**20})
            del model, caches
            if cuda:
                torch.cuda.empty_cache()
    return rows
