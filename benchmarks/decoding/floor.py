"""Decode steps against their byte floor, and what the bytes buy a server (issue 41).

    python benchmarks/decode.py floor [--sections floor,server] [--presets gpt2-base,llama-135m,llama-1.1b]
        [--kinds mha,gqa,mqa,mhe-mul] [--batches 1,8,64] [--contexts 4096,16384,32768]
        [--server-contexts 4096,32768] [--server-presets llama-135m,llama-1.1b] [--mode graph]
        [--reps 10] [--deadline 330] [--out results/logs]
    python benchmarks/decode.py floor --cpu-smoke     # tiny sizes on a CPU: the script end to end
    python benchmarks/decode.py floor --report [--card H100]   # the markdown tables of a saved run

Random weights in bf16, each (preset, kind) model built once on the card for the longest context.

``floor`` (``OUT/decode-floor-CARD.json``, a list of rows ``{card, preset, kind, batch, context,
step_ms, prefill_ms, bytes_per_step, floor_ms, fraction_of_bandwidth, ...}``): ``step_ms`` is one
decode step alone, the user path's step (the inference view: fast MHE folded, Q/K/V fused, the
decode plan :func:`~mhe.attention.kernels.decode_plan` picks for the batch and cache) over a
cache filled to ``context`` positions, next token chosen, timed as CUDA-graph replays
(``--mode graph``: the eager kernels captured; ``--mode compile``: inductor's, as
``model.generate`` runs it, one compilation per shape, so minutes; median of ``--reps``).
``bytes_per_step`` is what the step must read (paper-notes): every cached key and value of the
context once (``L * 2 * h_kv * d * context * batch * 2``) plus every weight once (the embedding
tables only where the output head shares them); ``floor_ms`` is that over the card's copy
bandwidth (a 1 GiB device-to-device copy, bytes read plus written), and
``fraction_of_bandwidth = floor_ms / step_ms``. ``prefill_ms`` is the prompt of the same setting
(``context - 256`` tokens a row, as in ``prompt + 256 new``) through ``model.generate(ids, 1)``
alone, timed on ``prefill_rows`` rows at a time (at most 65,536 tokens: the whole batch's
prefill at long contexts would not fit beside its activations) and scaled to the batch;
``prefill_fraction_of_peak`` is its model FLOPs (``2 * params * tokens`` for the matrix products
plus the causal attention's ``2 * L * n * d * T^2`` a row) over the card's dense bf16 peak. A
setting whose cache does not fit the card's free memory is skipped and listed.

``server`` (``OUT/decode-server-CARD.json`` and a markdown table): for each preset, kind and
context (prompt + 256 new), the largest batch whose caches and decode step fit the card beside
the weights (from the free memory and a one-row cache's bytes, then lowered by a tenth until the
step runs), and there ``decode_tokens_per_s`` (the batch over one step at the full context, so
every token of the 256 is counted at the slowest step's rate) and ``tokens_per_s`` (``batch * 256``
over the prefill, chunked as above and scaled, plus 256 such steps).

The whole default run fits about 6 minutes on one H100; rows past ``--deadline`` seconds are
skipped and listed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

from mhe.attention.fused_projections import fuse_projections
from mhe.bench.common import PEAK_BF16, bench_config, device_peak, timed
from mhe.models import build_model, layers
from mhe.attention.folding import inference_view, shared_copy
from mhe.attention.kernels import DecodePlan, decode_plan
from mhe.generation.step import compile_step, default_compile_options
from mhe.training.checkpoint import write_json_atomic

PRESETS = ("gpt2-base", "llama-135m", "llama-1.1b")
KINDS = ("mha", "gqa", "mqa", "mhe-mul")
NEW = 256
MARGIN = 64  # cache positions past the context (the timed replays write one each)
PREFILL_TOKENS = 65536  # the most prompt tokens one timed prefill call holds
RESERVE = 4 * 2**30  # bytes kept free beside the caches (the step's workspace, the allocator's slack)


def card_name() -> str:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return next((k for k in PEAK_BF16 if k in name), name.replace(" ", "-"))


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes per second of a 1 GiB device-to-device copy, read plus written (host memory on a CPU)."""
    n = 2**29 if dev.type == "cuda" else 2**22
    src = torch.empty(n, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), warmup=3, reps=20, cuda=dev.type == "cuda")
    return 2 * n * src.element_size() / (ms / 1e3)


def build(preset: str, kind: str, max_len: int, dev: torch.device, dtype: torch.dtype, small: bool) -> nn.Module:
    cfg = bench_config(preset, kind, small=small, gqa_heads=4, max_len=max_len, dropout=0.0, attn_dropout=0.0)
    with torch.device(dev):  # initialised on the card: a billion parameters are slow to initialise on a CPU
        model = build_model(cfg)
    return model.to(dtype).eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a decode step reads once: all parameters except embedding tables, of
    which a step reads a row per sequence, unless the output head shares them."""
    seen, total = set(), 0
    for mod in model.modules():
        if isinstance(mod, nn.Embedding):
            continue
        for p in mod.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
    return total


def matmul_params(model: nn.Module) -> int:
    """Parameters of the matrix products a prompt token goes through (not the embeddings, not the
    output head, which a prefill applies to the last position only)."""
    skip = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = getattr(model, "lm_head", None)
    if head is not None:
        skip.add(id(head.weight))
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) not in skip)


def cache_bytes_per_position(model: nn.Module, dtype: torch.dtype) -> int:
    """K/V bytes one cached position of one row takes over every layer."""
    caches = model.new_caches(1, 1, dtype=dtype, device="meta")
    return sum(c.kv.numel() for c in caches) * torch.finfo(dtype).bits // 8


def decode_view(model: nn.Module, batch: int, positions: int, dev, dtype,
                kernel: str | None = None) -> tuple[nn.Module, DecodePlan]:
    """The inference view ``model.generate`` decodes with (Q/K/V fused) and its decode plan (its
    kernel policy, or ``kernel``)."""
    view = inference_view(model)
    plan = decode_plan(model, dev, dtype, kernel, batch=batch, positions=positions)
    return fuse_projections(shared_copy(model) if view is model else view), plan


def decode_step(model, batch: int, context: int, *, dev, dtype, mode: str, kernel: str | None = None,
                compile_options: dict | None = None):
    """``(step, plan)``: one decode step of the user path over a cache filled to ``context``
    positions (random keys and values), the next token chosen; compiled by inductor in
    ``compile`` mode with ``compile_options`` (the caller gives ``model.generate``'s:
    :func:`~mhe.generation.step.default_compile_options`)."""
    view, plan = decode_view(model, batch, context + MARGIN, dev, dtype, kernel)
    caches = view.new_caches(batch, context + MARGIN, dtype=dtype, device=dev)
    for c in caches:
        c.kv.normal_()
    tok = torch.randint(0, model.cfg.vocab_size, (batch, 1), device=dev)

    def step():
        caches[0].index.fill_(context)  # the position every layer's cache shares
        with torch.no_grad():
            return view(tok, caches=caches, last_only=True, plan=plan).logits[:, -1].argmax(-1)

    return (compile_step(step, device=dev, options=compile_options) if mode == "compile" else step), plan


def step_ms(model, batch: int, context: int, *, dev, dtype, mode: str, reps: int,
            kernel: str | None = None, compile_options: dict | None = None, census=None) -> tuple[float, str]:
    """Median ms of one decode step (:func:`decode_step`) at ``context`` filled positions (a
    CUDA-graph replay on a GPU), and the plan's kernel; ``census(step)``, if given, is called on
    the same step after the timing (one compilation serves both)."""
    fn, plan = decode_step(model, batch, context, dev=dev, dtype=dtype, mode=mode, kernel=kernel,
                           compile_options=compile_options)
    ms = timed(fn, warmup=3, reps=reps, cuda=dev.type == "cuda", graph=dev.type == "cuda")
    if census is not None:
        census(fn)
    kernel = plan.kernel
    del fn
    return ms, kernel


def prefill_ms(model, rows: int, prompt: int, *, dev) -> float:
    """Median ms of ``model.generate(ids, 1)`` on ``rows`` prompts of ``prompt`` tokens (the
    prefill alone: one token chosen from its logits), eager steps, after a warm-up."""
    ids = torch.randint(0, model.cfg.vocab_size, (rows, prompt), device=dev)
    session = model.generator(rows, prompt + 1, step_mode="eager")
    model.generate(ids, 1, session=session)
    return timed(lambda: model.generate(ids, 1, session=session), warmup=0, reps=2, cuda=dev.type == "cuda")


def prefill_flops(model, rows: int, prompt: int) -> float:
    c = model.cfg
    attention = 2 * c.n_layers * c.n_heads * c.resolved_head_dim * prompt ** 2  # QK^T and AV, causal half
    return rows * (2 * matmul_params(model) * prompt + attention + 2 * c.d_model * c.vocab_size)


class Prefills:
    """Prefill times per (rows, prompt) of one model, measured once and scaled to a batch."""

    def __init__(self, model, dev, max_tokens: int) -> None:
        self.model, self.dev, self.max_tokens, self.done = model, dev, max_tokens, {}

    def rows(self, batch: int, prompt: int) -> int:
        return max(1, min(batch, self.max_tokens // prompt))

    def __call__(self, batch: int, prompt: int) -> tuple[float, int, float]:
        """(ms for the whole batch, rows timed per call, model FLOPs per ms timed)."""
        rows = self.rows(batch, prompt)
        if (rows, prompt) not in self.done:
            self.done[(rows, prompt)] = prefill_ms(self.model, rows, prompt, dev=self.dev)
        ms = self.done[(rows, prompt)]
        return ms * batch / rows, rows, prefill_flops(self.model, rows, prompt) / ms


def fits(model, batch: int, context: int, dtype) -> bool:
    need = cache_bytes_per_position(model, dtype) * batch * (context + MARGIN)
    return need + RESERVE <= free_bytes()


def free_bytes() -> int:
    if not torch.cuda.is_available():
        return 2**34
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def floor_rows(model, preset, kind, a, run) -> None:
    """Every (context, batch) of one model: its step, prefill and floor."""
    prefills = Prefills(model, run.dev, a.prefill_tokens)
    weights = weight_bytes(model)
    per_position = cache_bytes_per_position(model, run.dtype)
    for context in a.contexts:
        for batch in a.batches:
            label = f"{preset} {kind} {batch}x{context}"
            if not fits(model, batch, context, run.dtype):
                run.skip(label, "its cache does not fit the card")
                continue
            if run.late():
                run.skip(label, "past the deadline")
                continue
            opts = default_compile_options(batch, run.dev, a.compile_options) if a.mode == "compile" else None
            for gate_up in GATE_UP_CHOICES[a.gate_up]:
                with gate_up_products(gate_up):
                    hook = run.census_hook(model, preset, kind, batch, context) if run.census_hook else None
                    ms, kernel = step_ms(model, batch, context, dev=run.dev, dtype=run.dtype, mode=a.mode,
                                         reps=a.reps, kernel=a.kernel, compile_options=opts, census=hook)
                pre, rows, rate = prefills(batch, context - NEW) if a.prefill else (0.0, 0, 0.0)
                nbytes = per_position * batch * context + weights
                floor = nbytes / run.bandwidth * 1e3
                run.floor.append({"card": run.card, "preset": preset, "kind": kind, "batch": batch,
                                  "context": context, "step_ms": round(ms, 4), "prefill_ms": round(pre, 3),
                                  "bytes_per_step": nbytes, "floor_ms": round(floor, 4),
                                  "fraction_of_bandwidth": round(floor / ms, 3), "kernel": kernel, "mode": a.mode,
                                  "prefill_rows": rows, "prefill_fraction_of_peak":
                                  round(rate * 1e3 / run.peak, 3) if run.peak and a.prefill else None,
                                  **({"gate_up": gate_up} if a.gate_up != "fused" else {}),
                                  **({"compile_options": opts} if opts else {})})
                run.save()
                print(json.dumps(run.floor[-1]), flush=True)


GATE_UP_CHOICES = {"fused": ("fused",), "apart": ("apart",), "both": ("fused", "apart")}


@contextlib.contextmanager
def gate_up_products(how: str):
    """A gated feed-forward's gate and up as one product at inference (``fused``: the library's rule,
    :data:`mhe.models.layers.FUSE_MAX_BYTES`) or as two (``apart``: no pair is stacked)."""
    before = layers.FUSE_MAX_BYTES
    layers.FUSE_MAX_BYTES = before if how == "fused" else -1
    try:
        yield
    finally:
        layers.FUSE_MAX_BYTES = before


def server_row(model, preset, kind, context, a, run) -> None:
    """The largest batch whose caches and step fit at ``context``, and its tokens/s."""
    per_row = cache_bytes_per_position(model, run.dtype) * (context + MARGIN)
    batch = max(1, int((free_bytes() - RESERVE) // per_row)) if run.dev.type == "cuda" else 4
    for _ in range(6):
        try:
            ms, kernel = step_ms(model, batch, context, dev=run.dev, dtype=run.dtype, mode=a.mode, reps=a.reps)
            break
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            batch = int(batch * 0.9)
    else:
        run.skip(f"server {preset} {kind} {context}", "no batch fits")
        return
    pre, rows, _ = Prefills(model, run.dev, a.prefill_tokens)(batch, context - NEW)
    run.server.append({"card": run.card, "preset": preset, "kind": kind, "context": context, "batch": batch,
                       "kv_gib": round(per_row * batch / 2**30, 2), "step_ms": round(ms, 4),
                       "decode_tokens_per_s": round(batch / ms * 1e3),
                       "tokens_per_s": round(batch * NEW / ((pre + NEW * ms) / 1e3)),
                       "prefill_ms": round(pre, 1), "prefill_rows": rows, "kernel": kernel, "mode": a.mode})
    run.save()
    print(json.dumps(run.server[-1]), flush=True)


class Run:
    """What one invocation measured, written after every row."""

    def __init__(self, a) -> None:
        self.dev = torch.device("cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu")
        self.dtype = torch.bfloat16 if self.dev.type == "cuda" else torch.float32
        self.card, self.out, self.deadline, self.start = card_name(), Path(a.out), a.deadline, time.perf_counter()
        self.peak = device_peak(torch.cuda.get_device_name(0)) if self.dev.type == "cuda" else None
        self.bandwidth = copy_bandwidth(self.dev)
        self.floor, self.server, self.skipped = [], [], []
        self.census_hook = None  # ``census``: (model, preset, kind, batch, context) -> a call on the step
        print(f"{self.card}: copy bandwidth {self.bandwidth / 1e12:.2f} TB/s", flush=True)

    def late(self) -> bool:
        return self.deadline > 0 and time.perf_counter() - self.start > self.deadline

    def skip(self, label: str, why: str) -> None:
        self.skipped.append(f"{label}: {why}")
        print(f"skipped {label}: {why}", flush=True)

    def save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.floor:
            write_json_atomic(self.out / f"decode-floor-{self.card}.json", self.floor)
        if self.server:
            write_json_atomic(self.out / f"decode-server-{self.card}.json", self.server)
        write_json_atomic(self.out / f"decode-floor-{self.card}-run.json", {
            "card": self.card, "device": torch.cuda.get_device_name(0) if self.dev.type == "cuda" else "cpu",
            "torch": torch.__version__, "copy_bandwidth_bytes_per_s": self.bandwidth, "peak_bf16": self.peak,
            "seconds": round(time.perf_counter() - self.start, 1), "skipped": self.skipped})


def server_table(rows: list[dict]) -> str:
    """The README's table: per preset and context, each kind's batch and tokens/s."""
    lines = ["| model | context | kind | largest batch | KV cache (GiB) | decode tokens/s | tokens/s with prefill |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['preset']} | {r['context']:,} | {r['kind']} | {r['batch']:,} | {r['kv_gib']} | "
                     f"{r['decode_tokens_per_s']:,} | {r['tokens_per_s']:,} |")
    return "\n".join(lines)


def floor_table(rows: list[dict]) -> str:
    mha = {(r["preset"], r["batch"], r["context"]): r["step_ms"] for r in rows
           if r["kind"] == "mha" and r.get("gate_up", "fused") == "fused"}
    lines = ["| model | kind | batch | context | step ms | floor ms | of bandwidth | MHA step / this | prefill ms "
             "| prefill of peak |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = f"{r['prefill_fraction_of_peak']:.0%}" if r["prefill_fraction_of_peak"] is not None else "-"
        base = mha.get((r["preset"], r["batch"], r["context"]))
        vs = f"{base / r['step_ms']:.2f}x" if base else "-"
        kind = r["kind"] + (f" (gate/up {r['gate_up']})" if r.get("gate_up") else "")
        lines.append(f"| {r['preset']} | {kind} | {r['batch']} | {r['context']:,} | {r['step_ms']:.3f} | "
                     f"{r['floor_ms']:.3f} | {r['fraction_of_bandwidth']:.0%} | {vs} | {r['prefill_ms']:.1f} | {peak} |")
    return "\n".join(lines)


def targets(rows: list[dict], server: list[dict]) -> list[str]:
    """Issue 41's targets that these rows decide, each with its figure."""
    step = {(r["preset"], r["kind"], r["batch"], r["context"]): r for r in rows}
    out = []
    for kind in KINDS:
        r = step.get(("llama-1.1b", kind, 64, 4096))
        if r:
            ratio = r["step_ms"] / r["floor_ms"]
            out.append(f"llama-1.1b {kind} 64 x 4096: step {ratio:.2f}x its floor (target <= 1.5x): "
                       f"{'met' if ratio <= 1.5 else 'NOT met'}")
    mhe, mha, gqa = (step.get(("llama-135m", k, 64, 4096)) for k in ("mhe-mul", "mha", "gqa"))
    if mhe and mha and gqa:
        a, b = mha["step_ms"] / mhe["step_ms"], gqa["step_ms"] / mhe["step_ms"]
        out.append(f"llama-135m 64 x 4096: MHE-Mul {a:.2f}x MHA (target 5x), {b:.2f}x GQA (target 2.5x): "
                   f"{'met' if a >= 5 and b >= 2.5 else 'NOT met'}")
    srv = {(r["preset"], r["kind"], r["context"]): r for r in server}
    mhe, mha = srv.get(("llama-1.1b", "mhe-mul", 32768)), srv.get(("llama-1.1b", "mha", 32768))
    if mhe and mha:
        a = mhe["decode_tokens_per_s"] / mha["decode_tokens_per_s"]
        out.append(f"llama-1.1b 32,768, largest batch: MHE-Mul {a:.2f}x MHA's decode tokens/s (target 6x): "
                   f"{'met' if a >= 6 else 'NOT met'}")
    r = step.get(("llama-135m", "mhe-mul", 1, 4096))
    if r:
        out.append(f"llama-135m MHE-Mul batch 1, context 4,096: step {r['step_ms']:.3f} ms (the target, <= 1.0 ms a "
                   "token, is model.generate's: mhe bench --preset llama-135m --sections generate)")
    return out


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse(argv=None, *, prog: str = "decode.py floor", description: str = "", defaults: dict | None = None,
          more=None):
    """The floor's flags (``defaults`` replace some of their defaults; ``more(parser)`` adds a
    command's own flags: ``census`` and ``prefill`` run on the same rows)."""
    ap = argparse.ArgumentParser(prog=prog, description=description or __doc__.splitlines()[0])
    ap.add_argument("--sections", default="floor,server")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--batches", type=ints, default=[1, 8, 64])
    ap.add_argument("--contexts", type=ints, default=[4096, 16384, 32768])
    ap.add_argument("--server-presets", default="llama-135m,llama-1.1b")
    ap.add_argument("--server-contexts", type=ints, default=[4096, 32768])
    ap.add_argument("--mode", choices=("graph", "compile"), default="graph")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kernel", default=None, help="floor rows: decode with this kernel, not the policy's choice")
    ap.add_argument("--compile-options", type=json.loads, default=None,
                    help='floor rows, --mode compile: torch.compile options as JSON, as model.generate takes them '
                         '(e.g. \'{"options": {"coordinate_descent_tuning": true}}\')')
    ap.add_argument("--gate-up", choices=tuple(GATE_UP_CHOICES), default="fused",
                    help="floor rows: a gated feed-forward's gate and up as one product (fused, the default), two "
                         "(apart), or both side by side")
    ap.add_argument("--no-prefill", dest="prefill", action="store_false", help="floor rows: skip the prefill timing")
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS)
    ap.add_argument("--deadline", type=float, default=330.0, help="seconds after which no row starts (0: none)")
    ap.add_argument("--out", default="results/logs")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models and contexts on a CPU")
    ap.add_argument("--report", action="store_true", help="print the tables of the JSON files under --out, run nothing")
    ap.add_argument("--card", default=None, help="with --report: the card of the files (default: this machine's)")
    ap.set_defaults(**(defaults or {}))
    if more is not None:
        more(ap)
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.batches, a.contexts, a.server_contexts, a.reps, a.prefill_tokens = [1, 2], [300], [300], 2, 600
    return a


def report(out: Path, card: str) -> None:
    loaded = {}
    for name, table in ((f"decode-floor-{card}.json", floor_table), (f"decode-server-{card}.json", server_table)):
        if (out / name).exists():
            loaded[name] = json.loads((out / name).read_text())
            print(f"{name}:\n{table(loaded[name])}\n")
    print("\n".join(targets(loaded.get(f"decode-floor-{card}.json", []), loaded.get(f"decode-server-{card}.json", []))))


def main(argv=None) -> None:
    a = parse(argv)
    if a.report:
        report(Path(a.out), a.card or card_name())
        return
    measure(a, Run(a))


def measure(a, run: Run) -> None:
    """Every row the arguments ask for, saved as they come, then their tables."""
    sections = a.sections.split(",")
    presets = a.presets.split(",") if "floor" in sections else []
    server_presets = a.server_presets.split(",") if "server" in sections else []
    for preset in dict.fromkeys(presets + server_presets):
        for kind in a.kinds.split(","):
            contexts = (a.contexts if preset in presets else []) + (
                a.server_contexts if preset in server_presets else [])
            model = build(preset, kind, max(contexts) + MARGIN, run.dev, run.dtype, small=a.cpu_smoke)
            if preset in presets:
                floor_rows(model, preset, kind, a, run)
            for context in a.server_contexts if preset in server_presets else []:
                if run.late():
                    run.skip(f"server {preset} {kind} {context}", "past the deadline")
                    continue
                server_row(model, preset, kind, context, a, run)
            del model
            free_bytes()
    run.save()
    if run.floor:
        print(floor_table(run.floor))
    if run.server:
        print(server_table(run.server))
    print("\n".join(targets(run.floor, run.server)))
    print(f"{len(run.skipped)} skipped; {time.perf_counter() - run.start:.0f} s; "
          f"median fraction of bandwidth {statistics.median(r['fraction_of_bandwidth'] for r in run.floor):.2f}"
          if run.floor else f"{len(run.skipped)} skipped")

