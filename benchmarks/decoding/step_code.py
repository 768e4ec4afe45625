"""What each kernel of a compiled decode step computes: inductor's generated code, read back (issue 62).

    python benchmarks/decode.py step-code --preset llama-135m --kinds gqa,mha,mhe-mul --layers 2 \
        [--batch 1] [--context 512] [--rotary-step on|off] [--out DIR] [--json FILE]
    python benchmarks/decode.py step-code --smoke        # llama-tiny on a CPU (the C++ backend)

``census`` and ``profile`` name a step's kernels as the profiler sees them; inductor names a fused
kernel after at most a few of the operations it holds, so two kernels with the same name parts can
compute different things (GQA's query rotation and its keys' rotation, for instance). This reads
the step's own generated code instead: the model cut to ``--layers`` layers (a layer's launches
repeat) is compiled afresh for one decode step as ``model.generate`` runs it (a ``compile``
session), inductor's output code is captured from its ``output_code`` log, and for each compiled
graph the launches of its ``call`` function are printed in order, each with the source operations
inductor fused into it (its "Topologically Sorted Source Nodes" comment). ``--out`` keeps each
graph's whole code (``KIND-N.py``), ``--json`` the launches.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import re
from pathlib import Path

import torch

LOGGERS = ("torch._inductor.codecache.__output_code", "torch._inductor.graph.__output_code")
LAUNCH = re.compile(r"^\s*(?:\w+ = )?((?:triton|cpp)_\w+)(?:\.run)?\(|"
                    r"^\s*(?:\w+ = )?(extern_kernels\.\w+|torch\.ops\.[\w.]+)\(")
SOURCES = re.compile(r"^\s*# Topologically Sorted Source Nodes: \[(.*?)\]")


@contextlib.contextmanager
def captured_code():
    """Inductor's generated modules while the block runs, as a list of source strings (its
    ``output_code`` log, kept off the console)."""
    codes: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            text = record.getMessage()
            if text.startswith("Output code:"):
                codes.append(text.split("\n", 1)[1] if "\n" in text else "")
    keep = Keep()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    was = [(lg.propagate, lg.level) for lg in loggers]
    torch._logging.set_logs(output_code=True)
    for lg in loggers:
        lg.addHandler(keep)
        lg.propagate = False
    try:
        yield codes
    finally:
        for lg, (propagate, level) in zip(loggers, was):
            lg.removeHandler(keep)
            lg.propagate, lg.level = propagate, level
        torch._logging.set_logs()


def launches(code: str) -> list[dict]:
    """The launches of a generated module's ``call`` function, in order: ``{"kernel", "sources"}``,
    the sources being the operations inductor's comment before the launch names (empty where none)."""
    out, body, sources = [], False, ""
    for line in code.splitlines():
        if re.match(r"\s*def call\(self, args\):|def call\(args\):", line):
            body, sources = True, ""
            continue
        if not body:
            continue
        if re.match(r"\s*return \(|\s*return \[|\s*return$", line):
            body = False
        elif m := SOURCES.match(line):
            sources = m.group(1)
        elif m := LAUNCH.match(line):
            out.append({"kernel": m.group(1) or m.group(2), "sources": sources})
            sources = ""
    return out


def step_graphs(model, batch: int, context: int, dev) -> list[str]:
    """The code inductor generates for ``model``'s compiled decode step (and its token choice):
    a fresh compile, inductor's caches off, of a ``compile`` session's steps."""
    torch.manual_seed(0)
    ids = torch.randint(3, model.cfg.vocab_size, (batch, context // 2), device=dev)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), captured_code() as codes:
        session = model.generator(batch, context, step_mode="compile")
        model.generate(ids, 3, session=session)
    torch._dynamo.reset()
    return list(codes)


def print_graphs(kind: str, layers: int, graphs: list[list[dict]]) -> None:
    """Each graph's launches, the step (the graph with the most) first."""
    order = sorted(range(len(graphs)), key=lambda i: -len(graphs[i]))
    for rank, i in enumerate(order):
        what = f"the step ({layers} layers)" if rank == 0 else "another graph"
        print(f"== {kind}: graph {i}, {what}: {len(graphs[i])} launches", flush=True)
        for launch in graphs[i]:
            sources = launch["sources"]
            print(f"   {launch['kernel']}" + (f"\n      <- [{sources[:240]}]" if sources else ""), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="decode.py step-code", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-135m")
    ap.add_argument("--kinds", default="gqa,mha,mhe-mul")
    ap.add_argument("--layers", type=int, default=2, help="the model cut to this many layers")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512, help="the cache's positions (the prompt: half)")
    ap.add_argument("--rotary-step", choices=["on", "off"], help="kv_cache.ROTARY_STEP so set (default: as it is)")
    ap.add_argument("--out", default="", help="a folder for each graph's whole code")
    ap.add_argument("--json", default="")
    ap.add_argument("--smoke", action="store_true", help="llama-tiny on a CPU")
    a = ap.parse_args(argv)
    if a.layers < 1 or a.batch < 1 or a.context < 5:
        ap.error(f"--layers and --batch must be at least 1 and --context at least 5: a prompt of half of it "
                 f"and 3 new tokens (got {a.layers}, {a.batch}, {a.context})")
    from mhe.attention import kv_cache
    from mhe.models import build_model

    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    preset = "llama-tiny" if a.smoke else a.preset
    rows, switch = {}, kv_cache.ROTARY_STEP if a.rotary_step is None else a.rotary_step == "on"
    for kind in a.kinds.split(","):
        opts = {"n_kv_heads": 2 if a.smoke else 3} if kind == "gqa" else None
        torch.manual_seed(0)
        model = build_model(preset, attention=kind, attn_options=opts, n_layers=a.layers, max_len=a.context,
                            dropout=0.0, attn_dropout=0.0).to(dev, dtype).eval()
        was = kv_cache.ROTARY_STEP
        kv_cache.ROTARY_STEP = switch
        try:
            codes = step_graphs(model, a.batch, a.context, dev)
        finally:
            kv_cache.ROTARY_STEP = was
        graphs = [launches(code) for code in codes]
        print_graphs(kind, a.layers, graphs)
        rows[kind] = graphs
        if a.out:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            for i, code in enumerate(codes):
                (Path(a.out) / f"{kind}-{i}.py").write_text(code)
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {card}; torch {torch.__version__}; {preset} cut to {a.layers} layers, batch {a.batch}, "
          f"context {a.context}"
          + f", rotary step {'on' if switch else 'off'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": card, "preset": preset, "layers": a.layers,
                                            "rotary_step": switch,
                                            "kinds": rows}, indent=1))
    return 0
