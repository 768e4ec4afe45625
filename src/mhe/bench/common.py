"""What every section of ``mhe bench`` shares: the kinds, the smoke sizes, the card's peak
and the one timer."""

from __future__ import annotations

import statistics
import time
from typing import Callable

from mhe.attention.spec import AttentionSpec, attention_spec
from mhe.models import preset as model_preset

BENCH_KINDS = ("mha", "mqa", "gqa", "sha", "skv", "el-att", "mhe-add", "mhe-mul")
SMOKE = "smoke sizes: every model shrunk to 2 layers, width 64, 4 heads, vocabulary 512"
SMOKE_SIZES = dict(d_model=64, n_heads=4, n_layers=2, d_ff=128, vocab_size=512)
# Dense bf16 tensor-core peak, from the vendors' datasheets (SXM parts).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def bench_config(preset: str, kind: str | AttentionSpec, *, small: bool, gqa_heads: int | None = None, **overrides):
    """The model a bench row measures: ``preset`` with attention ``kind`` and ``overrides``. GQA
    keeps the preset's own grouping where the preset is grouped (llama-135m: 3 K/V heads), else
    ``gqa_heads`` or the default group count; ``small`` shrinks every model to
    :data:`SMOKE_SIZES` (GQA then 2 K/V heads)."""
    cfg, spec = model_preset(preset), attention_spec(kind)
    if spec.grouped and (small or (gqa_heads and not cfg.spec.grouped)):
        overrides["attn_options"] = {"n_kv_heads": 2 if small else gqa_heads}
    return cfg.replace(attention=spec, **{**overrides, **(SMOKE_SIZES if small else {})})


def model_shape(cfg) -> str:
    """What was measured, e.g. ``12L x 768 (12 heads), vocab 50257``: smoke sizes shrink every
    preset, so a row's preset name alone would not say."""
    return f"{cfg.n_layers}L x {cfg.d_model} ({cfg.n_heads} heads), vocab {cfg.vocab_size}"


def device_peak(name: str) -> float | None:
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None


def flops_per_token(n_params: int, cfg, seq_len: int) -> int:
    """Model FLOPs per trained token: 6N for the weights plus 12 L T n d for the attention scores
    (Chowdhery et al. 2022, Appendix B), causal masking ignored."""
    return 6 * n_params + 12 * cfg.n_layers * seq_len * cfg.n_heads * cfg.resolved_head_dim


def timed(fn: Callable[[], object], *, warmup: int, reps: int, cuda: bool, graph: bool = False) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls: CUDA events around each call on a
    GPU (the wall time of the call, host gaps included), the host clock elsewhere. ``graph``:
    time replays of ``fn`` captured once as a CUDA graph (the decode step's runner, so no
    launch overhead)."""
    import torch  # here: the kinds and sizes above are read without torch (``mhe bench --help``)

    from mhe.generation.step import StepRunner

    if graph:  # the decode step runner's capture: warm-up on a side stream, then one graph
        call = fn  # the lambda must not see the name rebound to the runner (it would call itself)
        fn = StepRunner(lambda _: call(), [torch.zeros((), device="cuda")], mode="graph")
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
