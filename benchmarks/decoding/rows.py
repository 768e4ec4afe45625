"""The measurements of ``decode.py speed`` that any tree can run: user-API calls only.

A row builds ``build_model(preset, attention=K, max_len=P+N)`` in the run's dtype, then times
``model.generate(ids, N, attention_mask=mask)`` (random weights, greedy, no stop token, prefill
included): the first call (it captures or compiles the step), then, after one more, the
median of ``reps`` calls; and ``model.generate(ids, 1, ...)`` the same way, the prefill with one
choice, so that ``(t_N - t_1) / (N - 1)`` is the decode step alone. :func:`kernels_per_token` counts what one
more generated token launches: device kernels on a GPU (CUDA-graph replays included, as the
profiler reports a graph's kernels), leaf aten operators on a CPU.

As ``decode.py rows`` it is the worker for an older tree (``PYTHONPATH=OLD/src python
benchmarks/decode.py rows OUT.json --settings 1x512,64x512 --kinds mha,mqa``): the same rows
with that tree's ``model.generate``, written as JSON; it imports nothing else of the tree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

SMOKE = dict(d_model=64, n_heads=4, n_layers=2, d_ff=128, vocab_size=512)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def timed(call, dev: torch.device, reps: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of ``reps`` more after one untimed call: a prompt
    shape's second call captures its prefill, or compiles a long one)."""
    sync(dev)
    t0 = time.perf_counter()
    call()
    sync(dev)
    first = time.perf_counter() - t0
    call()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def build(preset: str, kind: str, length: int, dev, dtype, smoke: bool):
    from mhe.models import build_model

    torch.manual_seed(0)
    extra = dict(SMOKE, **({"attn_options": {"n_kv_heads": 2}} if kind == "gqa" else {})) if smoke else {}
    return build_model(preset, attention=kind, max_len=length, dropout=0.0, attn_dropout=0.0, **extra).to(
        dev, dtype).eval()


def prompts(model, batch: int, prompt: int, dev):
    g = torch.Generator().manual_seed(batch * 100003 + prompt)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, prompt), generator=g).to(dev)
    return ids, torch.ones_like(ids)


def generate_row(model, ids, mask, new: int, dev, reps: int, **options) -> dict:
    """Timings of ``model.generate(ids, new, attention_mask=mask, **options)`` and of one token."""
    first, sec = timed(lambda: model.generate(ids, new, attention_mask=mask, **options), dev, reps)
    _, one = timed(lambda: model.generate(ids, 1, attention_mask=mask, **options), dev, reps)
    b = ids.shape[0]
    return {"first_call_s": first, "seconds": sec, "prefill_s": one, "ms_per_token": 1000 * sec / new,
            "tokens_per_s": b * new / sec, "decode_ms_per_step": 1000 * (sec - one) / (new - 1),
            "decode_tokens_per_s": b * (new - 1) / max(sec - one, 1e-9)}


def _count(prof, dev: torch.device) -> tuple[int, float, dict]:
    """(device kernels or leaf aten operators, their device microseconds, and per kernel name its
    [count, microseconds]) in a profile."""
    events = prof.events()
    if dev.type == "cuda":
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        names: dict[str, list] = {}
        for e in kernels:
            slot = names.setdefault(e.name, [0, 0.0])
            slot[0], slot[1] = slot[0] + 1, slot[1] + e.device_time
        return len(kernels), sum(e.device_time for e in kernels), names
    leaves = [e for e in events if e.name.startswith("aten::") and not e.cpu_children]
    return len(leaves), 0.0, {}


def kernels_per_token(model, ids, mask, dev, *, lengths=(4, 20), top: int = 0, **options) -> dict:
    """What one more generated token launches (the difference of two calls, so the prefill and the
    call's fixed work cancel): kernels (GPU) or leaf operators (CPU), and GPU-busy microseconds;
    with ``top``, the ``top`` kernels by device time per token (name, launches, microseconds)."""
    counts = []
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    room = model.cfg.max_len - ids.shape[1]
    lengths = lengths if lengths[1] <= room else (2, room)
    for n in lengths:
        for _ in range(2):  # warm: the first call compiles the step, the second captures the prefill
            model.generate(ids, n, attention_mask=mask, **options)
        sync(dev)
        with profile(activities=activities) as prof:
            model.generate(ids, n, attention_mask=mask, **options)
            sync(dev)
        counts.append(_count(prof, dev))
    steps = lengths[1] - lengths[0]
    per_name = {k: [(v[0] - counts[0][2].get(k, [0, 0.0])[0]) / steps, (v[1] - counts[0][2].get(k, [0, 0.0])[1]) / steps]
                for k, v in counts[1][2].items()}
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_per_token": (counts[1][0] - counts[0][0]) / steps,
            "busy_us_per_token": (counts[1][1] - counts[0][1]) / steps,
            "counted": "device kernels" if dev.type == "cuda" else "leaf aten operators",
            **({"top_kernels": [{"name": k[:120], "launches": v[0], "us": v[1]} for k, v in ranked]} if top else {})}


def kernels_of_prefill(model, ids, mask, dev, *, top: int = 0, **options) -> dict:
    """What one call for one new token launches (the prefill, then one eager choice), after two
    warm-up calls (a prompt shape's second call captures its prefill, or compiles a long one):
    kernels (GPU) or leaf operators (CPU), their device microseconds, and with ``top`` the
    ``top`` kernels by device time (name, launches, microseconds)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for _ in range(2):
        model.generate(ids, 1, attention_mask=mask, **options)
    sync(dev)
    with profile(activities=activities) as prof:
        model.generate(ids, 1, attention_mask=mask, **options)
        sync(dev)
    n, busy, names = _count(prof, dev)
    ranked = sorted(names.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": n, "busy_us": busy,
            "counted": "device kernels" if dev.type == "cuda" else "leaf aten operators",
            **({"top_kernels": [{"name": k[:120], "launches": v[0], "us": v[1]} for k, v in ranked]} if top else {})}


def release(dev: torch.device) -> None:
    import gc

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def worker(out: str, settings: list[tuple[int, int]], kinds: list[str], *, preset: str, new: int, reps: int,
           smoke: bool, kernel_kinds: list[str]) -> None:
    """The rows of this tree's ``model.generate`` (its defaults), written to ``out``."""
    dev = torch.device("cuda" if torch.cuda.is_available() and not smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for batch, context in settings:
        for kind in kinds:
            model = build(preset, kind, context, dev, dtype, smoke)
            ids, mask = prompts(model, batch, context - new, dev)
            row = {"batch": batch, "context": context, "kind": kind,
                   **generate_row(model, ids, mask, new, dev, reps)}
            if batch == 1 and kind in kernel_kinds:
                row.update(kernels_per_token(model, ids, mask, dev))
            rows.append(row)
            del model
            release(dev)
    with open(out, "w") as f:
        json.dump({"rows": rows, "torch": torch.__version__}, f, indent=1)


def parse_settings(spec: str) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in s.split("x")) for s in spec.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py rows", description="decode.py speed's rows in the tree on PYTHONPATH (an older one)")
    ap.add_argument("out")
    ap.add_argument("--settings", default="1x512,64x512,64x4096")
    ap.add_argument("--kinds", default="mha,mqa,mhe-mul")
    ap.add_argument("--kernel-kinds", default="mha,mhe-mul")
    ap.add_argument("--preset", default="gpt2-base")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    worker(a.out, parse_settings(a.settings), a.kinds.split(","), preset=a.preset, new=a.new, reps=a.reps,
           smoke=a.smoke, kernel_kinds=a.kernel_kinds.split(","))

