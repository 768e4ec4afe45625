"""The kernels of one decode step, per layer, per kind and batch (issue 62): why one kind's step is
slower than another's when its bytes say otherwise.

    python benchmarks/decode.py census [--presets llama-135m] [--kinds mha,gqa,mhe-mul] [--batches 1,64]
        [--contexts 4096] [--mode compile] [--no-prefill] [--out results/logs]   # the floor's flags too
    python benchmarks/decode.py census --cpu-smoke --mode graph     # tiny sizes on a CPU, end to end

Runs the ``floor`` command's rows (same step, same compilation: ``OUT/decode-floor-CARD.json``)
and, on each row's step after its timing, the profiler over ``--census-reps`` calls of the step
(its kernels launched one by one, as the CUDA graph that ``model.generate`` replays holds them):

* per step: kernels, their device microseconds, and both per category (``product``: cuBLAS and
  inductor's product templates; ``attention``: the decode attention kernel(s); ``reduction`` and
  ``elementwise``: inductor's generated kernels, RMSNorm, rotary, SwiGLU, residuals, the cache
  write; ``copy``: copies and fills; ``other``);
* per layer: the shortest run of kernels that repeats once a layer over the middle layers (the
  first and last layer may fuse with the embedding or the final norm), each kernel with its
  category and microseconds; kernels outside those layers are the step's own (embedding, final
  norm, output head, the token choice).

On a CPU it counts leaf aten operators instead of kernels (their CPU microseconds), which is what
the CPU test checks: a deeper model adds one layer's operators a layer.
Writes ``OUT/decode-census-CARD.json`` (a list of rows) and prints a table per row.
"""

from __future__ import annotations

import json
import re
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from decoding import floor
from mhe.training.checkpoint import write_json_atomic

#: (category, substrings of a kernel's or operator's name), the first match wins
CATEGORIES = (
    ("attention", ("_split_kernel", "_merge_kernel", "flash", "fmha", "sdpa", "cudnn", "attention", "decode_kernel")),
    ("product", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "cublas", "splitkreduce", "triton_tem", "aten::mm",
                 "aten::addmm", "aten::bmm", "aten::_int_mm", "aten::linear", "aten::matmul")),
    ("reduction", ("triton_red", "triton_per", "reduce", "aten::mean", "aten::sum", "aten::amax", "aten::argmax",
                   "aten::max", "aten::rsqrt")),
    ("elementwise", ("triton_poi", "elementwise", "vectorized", "aten::mul", "aten::add", "aten::silu", "aten::neg",
                     "aten::cat", "aten::sigmoid", "aten::pow", "aten::div", "aten::sub", "aten::where")),
    ("copy", ("memcpy", "memset", "copy", "fill", "index_put", "scatter", "aten::index", "aten::embedding")),
)


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


#: aten operators that move no data (views, metadata, allocation): not counted on a CPU
NO_DATA = frozenset(f"aten::{n}" for n in (
    "as_strided", "view", "_unsafe_view", "alias", "resolve_conj", "resolve_neg", "empty", "empty_strided", "resize_",
    "empty_like", "promote_types", "result_type", "to", "_to_copy", "_local_scalar_dense", "item", "detach", "t",
    "transpose", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "contiguous", "unflatten",
    "split", "split_with_sizes", "chunk", "narrow", "dropout", "lift_fresh", "unbind", "flatten", "view_as"))


def cpu_operators(events) -> list:
    """The outermost aten operators that move data (a CPU's stand-in for kernels): one whose
    callers are none (``aten::linear``, not the ``aten::mm`` inside it; ``aten::copy_`` inside
    ``aten::to``, which is a view where the dtype already matches)."""
    def counted(e) -> bool:
        return e.name.startswith("aten::") and e.name not in NO_DATA

    def called_by_one(e) -> bool:
        parent = e.cpu_parent
        while parent is not None:
            if counted(parent):
                return True
            parent = parent.cpu_parent
        return False
    return [e for e in events if counted(e) and not called_by_one(e)]


def launches(fn, dev: torch.device, reps: int) -> list[tuple[str, float]]:
    """``(name, microseconds)`` of every kernel one call of ``fn`` launches, in launch order
    (the median call's times: the first of ``reps`` calls gives the order, all give the times);
    leaf aten operators and CPU microseconds on a CPU."""
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(reps):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    if dev.type == "cuda":
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        timing = lambda e: e.device_time  # noqa: E731
    else:
        events = cpu_operators(prof.events())
        timing = lambda e: e.cpu_time  # noqa: E731
    events.sort(key=lambda e: e.time_range.start)
    if len(events) % reps:
        raise RuntimeError(f"{len(events)} kernels over {reps} calls: the calls launched different kernels")
    per = len(events) // reps
    calls = [events[i * per:(i + 1) * per] for i in range(reps)]
    return [(e.name, sorted(timing(c[i]) for c in calls)[reps // 2])
            for i, e in enumerate(calls[0])]


def layer_run(names: list[str], layers: int) -> tuple[int, int]:
    """``(start, length)`` of the longest run of names that repeats back to back over all
    ``layers`` (else over ``layers - 1``, ``layers - 2``: the first and last layer may fuse with
    their neighbours), the earliest such start; ``(0, 0)`` if none. The longest, since a layer's
    own repeats (one operator twice in a row) are shorter runs, and twice a layer cannot repeat
    that often."""
    for need in (layers, layers - 1, layers - 2):
        if need < 2:
            break
        for length in range(len(names) // need, 0, -1):
            for start in range(0, len(names) - length * need + 1):
                block = names[start:start + length]
                if all(names[start + k * length:start + (k + 1) * length] == block for k in range(1, need)):
                    return start, length
    return 0, 0


def kernel_family(name: str) -> str:
    """A kernel's name without inductor's serial number: inductor generates one kernel twice (say
    ``triton_per_fused_..._15`` and ``..._12``, a layer's RMSNorm) where alternate layers read
    alternate buffers, so the same layer's kernels differ by that number alone."""
    return re.sub(r"^(triton_\w+)_\d+$", r"\1", name)


def census(kernels: list[tuple[str, float]], layers: int) -> dict:
    """The step's kernels summed per category, and one layer's run of kernels (:func:`layer_run`
    over :func:`kernel_family` names)."""
    names = [kernel_family(n) for n, _ in kernels]
    cats: dict[str, list] = {}
    for name, us in kernels:
        slot = cats.setdefault(category(name), [0, 0.0])
        slot[0], slot[1] = slot[0] + 1, slot[1] + us
    start, length = layer_run(names, layers)
    layer = kernels[start + length:start + 2 * length] if length else []  # the second layer of the run
    repeats = 0
    while length and names[start + repeats * length:start + (repeats + 1) * length] == names[start:start + length]:
        repeats += 1
    per_layer = Counter(category(n) for n, _ in layer)
    return {"kernels_per_step": len(kernels), "us_per_step": round(sum(us for _, us in kernels), 2),
            "per_category": {c: {"launches": v[0], "us": round(v[1], 2)} for c, v in sorted(cats.items())},
            "kernels_per_layer": length, "layers_repeating": repeats,
            "per_layer_by_category": dict(sorted(per_layer.items())),
            "us_per_layer": round(sum(us for _, us in layer), 2),
            "layer": [{"name": n[:160], "category": category(n), "us": round(us, 2)} for n, us in layer],
            "outside_layers": len(kernels) - repeats * length}


class Census:
    """The hook the floor's rows call on each step (``Run.census_hook``), and the rows it made."""

    def __init__(self, run, reps: int) -> None:
        self.run, self.reps, self.rows = run, reps, []

    def __call__(self, model, preset: str, kind: str, batch: int, context: int):
        def hook(fn) -> None:
            layers = model.cfg.n_layers
            row = {"card": self.run.card, "preset": preset, "kind": kind, "batch": batch, "context": context,
                   "layers": layers, "counted": "device kernels" if self.run.dev.type == "cuda" else
                   "leaf aten operators", "compiled": not getattr(fn, "fell_back", True),
                   **census(launches(fn, self.run.dev, self.reps), layers)}
            self.rows.append(row)
            self.save()
            print(table(row), flush=True)
        return hook

    def save(self) -> None:
        self.run.out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.run.out / f"decode-census-{self.run.card}.json", self.rows)


def table(row: dict) -> str:
    """One row's census: per step and per layer by category, then one layer's kernels."""
    head = (f"{row['preset']} {row['kind']} batch {row['batch']} x {row['context']:,}: {row['kernels_per_step']} "
            f"{row['counted']} a step ({row['us_per_step']:.1f} us), {row['kernels_per_layer']} a layer "
            f"({row['us_per_layer']:.1f} us) repeating over {row['layers_repeating']} of {row['layers']} layers, "
            f"{row['outside_layers']} outside them")
    cats = "; ".join(f"{c} {v['launches']} ({v['us']:.1f} us)" for c, v in row["per_category"].items())
    lines = [head, f"  a step: {cats}", "  a layer: " + ", ".join(
        f"{c} {n}" for c, n in row["per_layer_by_category"].items())]
    lines += [f"    {k['us']:8.2f} us  {k['category']:<11} {k['name'][:110]}" for k in row["layer"]]
    return "\n".join(lines)


def summary(rows: list[dict]) -> str:
    """Kinds side by side: kernels a step and a layer, per category a layer, microseconds a step."""
    cats = [c for c, _ in CATEGORIES] + ["other"]
    lines = ["| model | kind | batch | kernels a step | a layer | " + " | ".join(cats) + " | us a step |",
             "|---|---|---:|---:|---:|" + "---:|" * len(cats) + "---:|"]
    for r in rows:
        per = " | ".join(str(r["per_layer_by_category"].get(c, 0)) for c in cats)
        lines.append(f"| {r['preset']} | {r['kind']} | {r['batch']} | {r['kernels_per_step']} | "
                     f"{r['kernels_per_layer']} | {per} | {r['us_per_step']:.1f} |")
    return "\n".join(lines)


DEFAULTS = dict(sections="floor", presets="llama-135m", kinds="mha,gqa,mhe-mul", batches=[1, 64], contexts=[4096],
                mode="compile")


def main(argv: list[str] | None = None) -> None:
    a = floor.parse(argv, prog="decode.py census", description=__doc__.splitlines()[0], defaults=DEFAULTS,
                    more=lambda ap: ap.add_argument("--census-reps", type=int, default=5,
                                                    help="calls of the step profiled (the median's times)"))
    run = floor.Run(a)
    hook = Census(run, a.census_reps)
    run.census_hook = hook
    floor.measure(a, run)
    if hook.rows:
        print(summary(hook.rows))
        print(json.dumps({"census_rows": len(hook.rows)}))
