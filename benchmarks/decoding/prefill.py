"""A long prompt's prefill alone, and its share of the card's peak bf16 throughput (issue 62).

    python benchmarks/decode.py prefill [--presets llama-135m,llama-1.1b] [--kinds mha,gqa,mhe-mul]
        [--batch 64] [--prompt 3840] [--rows 16,64] [--out results/logs]
    python benchmarks/decode.py prefill --cpu-smoke          # tiny sizes on a CPU, end to end

For each preset and kind (random weights, bf16 on a GPU), ``model.generate(ids, 1)`` on ``rows``
prompts of ``--prompt`` tokens at a time (the prefill, then one token chosen; eager, after a
warm-up call; the median of ``--reps``), scaled to ``--batch`` rows. Its model FLOPs are the
floor's (:func:`decoding.floor.prefill_flops`): ``2 * N * tokens`` for the matrix products (N: the
parameters a prompt token goes through, not the embeddings), the causal attention's
``2 * L * n * d * T^2`` a row (QK^T and AV over half the square), and the output head at the
last position; ``fraction_of_peak`` is their rate over the card's dense bf16 peak
(``mhe.bench.common.PEAK_BF16``). Writes ``OUT/decode-prefill-CARD.json`` (a list of rows).

``--compiled`` also times the prefill as ``model.generate`` runs it in a ``compile`` session
(the default on a GPU): from ``PREFILL_COMPILE_TOKENS`` prompt tokens a shape's second call
compiles the prefill for that shape (``Generator.prefill``); the row gets the compiled call's
time, the compile's seconds and the logits' largest difference from the eager first call's
(relative to the largest logit). On a CPU (``--cpu-smoke``) it compiles with the ``aot_eager``
backend.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from decoding import floor
from mhe.bench.common import timed
from mhe.training.checkpoint import write_json_atomic


def prefill_row(model, preset: str, kind: str, rows: int, a, dev, peak) -> dict:
    """One (preset, kind, rows) prefill, scaled to the batch."""
    ms = floor.prefill_ms(model, rows, a.prompt, dev=dev)
    flops = floor.prefill_flops(model, rows, a.prompt)
    c = model.cfg
    attention = 2 * c.n_layers * c.n_heads * c.resolved_head_dim * a.prompt ** 2 * rows
    rate = flops / (ms / 1e3)
    return {"preset": preset, "kind": kind, "batch": a.batch, "prompt": a.prompt, "rows": rows,
            "ms": round(ms * a.batch / rows, 2), "ms_per_call": round(ms, 2),
            "tokens_per_s": round(rows * a.prompt / (ms / 1e3)), "matmul_params": floor.matmul_params(model),
            "flops_per_call": flops, "attention_share_of_flops": round(attention / flops, 3),
            "tflops_per_s": round(rate / 1e12, 1), "fraction_of_peak": round(rate / peak, 3) if peak else None}


def compiled_prefill(model, rows: int, prompt: int, dev) -> dict:
    """``model.generate(ids, 1)`` of ``rows`` x ``prompt`` in a ``compile`` session, which compiles
    a long prefill for its shape at the shape's second call (``Generator.prefill``): the median
    ms of the calls after it, that second call's seconds (the compile) and its logits' largest
    difference from the first, eager call's, relative to the largest logit."""
    ids = torch.randint(0, model.cfg.vocab_size, (rows, prompt), device=dev)
    options = {"backend": "aot_eager"} if dev.type == "cpu" else None
    session = model.generator(rows, prompt + 1, step_mode="compile", compile_options=options)

    def call():
        return model.generate(ids, 1, session=session, return_logits=True)[1][:, 0].float()
    want = call()  # the shape's first call: eager
    t0 = time.perf_counter()
    got = call()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    ms = timed(call, warmup=1, reps=3, cuda=dev.type == "cuda")
    diff = ((got - want).abs().max() / want.abs().max()).item()
    compiled = any(not r.fell_back for r in session.compiled_prefills.runners.values())
    return {"compiled_ms_per_call": round(ms, 2), "compile_s": round(compile_s, 1), "compiled_rel_diff": diff,
            "compiled": compiled}


def compiled_row(model, row: dict, a, dev, peak) -> dict:
    """The compiled prefill of the row's shape, scaled to the batch as the row is."""
    got = compiled_prefill(model, row["rows"], a.prompt, dev)
    ms = got["compiled_ms_per_call"]
    rate = row["flops_per_call"] / (ms / 1e3)
    return {**got, "compiled_ms": round(ms * a.batch / row["rows"], 2),
            "compiled_fraction_of_peak": round(rate / peak, 3) if peak else None}


def share(x: float | None) -> str:
    return f"{x:.0%}" if x is not None else "-"


def table(rows: list[dict]) -> str:
    """The rows as markdown; with the compiled prefill's columns where rows have them."""
    compiled = any("compiled_ms" in r for r in rows)
    head = ("| model | kind | rows a call | batch x prompt | prefill ms (batch) | tokens/s | attention of FLOPs | "
            "TFLOP/s | of bf16 peak |")
    rule = "|---|---|---:|---|---:|---:|---:|---:|---:|"
    if compiled:
        head, rule = head + " compiled ms (batch) | compiled, of peak | compile s | logits' difference |", rule + "---:|" * 4
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['preset']} | {r['kind']} | {r['rows']} | {r['batch']} x {r['prompt']:,} | {r['ms']:.1f} | "
                f"{r['tokens_per_s']:,} | {r['attention_share_of_flops']:.0%} | {r['tflops_per_s']} | "
                f"{share(r['fraction_of_peak'])} |")
        if compiled:
            line += (f" {r['compiled_ms']:.1f} | {share(r['compiled_fraction_of_peak'])} | {r['compile_s']} | "
                     f"{r['compiled_rel_diff']:.1e} |" if "compiled_ms" in r else " - | - | - | - |")
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py prefill", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="llama-135m,llama-1.1b")
    ap.add_argument("--kinds", default="mha,gqa,mhe-mul")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=3840)
    ap.add_argument("--rows", type=floor.ints, default=[16, 64], help="prompts a call, each its own row")
    ap.add_argument("--deadline", type=float, default=0.0, help="seconds after which no row starts (0: none)")
    ap.add_argument("--out", default="results/logs")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny models and prompts on a CPU")
    ap.add_argument("--compiled", action="store_true",
                    help="also the prefill of a compile session (compiled for its shape from its second call)")
    a = ap.parse_args(argv)
    if a.cpu_smoke:
        a.batch, a.prompt, a.rows = 4, 40, [2, 4]
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    card = floor.card_name() if dev.type == "cuda" else "cpu"
    peak = floor.device_peak(torch.cuda.get_device_name(0)) if dev.type == "cuda" else None
    out, start, done = Path(a.out), time.perf_counter(), []
    for preset in a.presets.split(","):
        for kind in a.kinds.split(","):
            model = floor.build(preset, kind, a.prompt + 1, dev, dtype, small=a.cpu_smoke)
            for rows in a.rows:
                if a.deadline and time.perf_counter() - start > a.deadline:
                    print(f"skipped {preset} {kind} {rows} rows: past the deadline", flush=True)
                    continue
                try:
                    row = {"card": card, **prefill_row(model, preset, kind, min(rows, a.batch), a, dev, peak)}
                    if a.compiled:
                        row.update(compiled_row(model, row, a, dev, peak))
                    done.append(row)
                except torch.cuda.OutOfMemoryError:
                    print(f"skipped {preset} {kind} {rows} rows: out of memory", flush=True)
                    continue
                out.mkdir(parents=True, exist_ok=True)
                write_json_atomic(out / f"decode-prefill-{card}.json", done)
                print(table(done[-1:]).splitlines()[-1], flush=True)
            del model
            floor.free_bytes()
    print(table(done))
