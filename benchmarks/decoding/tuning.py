"""The one-row decode step's launch-configuration tuning, over fresh compiles: does its pick vary,
and what does each way of tuning cost a token (issue 62's batch-1 spread)?

    python benchmarks/decode.py tuning --preset llama-135m --kinds mha,gqa,mhe-mul \
        --tunings default,event-clock,off [--kernels auto,sdpa,split-k-decode] [--rotations separate,kernel]
        --repeats 2 [--top 4]
        [--tuner-log FILE] [--json FILE]
    python benchmarks/decode.py tuning --smoke          # the tool's plumbing on a CPU (tiny sizes)

A compiled step of one row on CUDA is tuned by inductor's coordinate descent
(``ONE_ROW_COMPILE_OPTIONS``), which times candidate launch configurations of each generated
kernel on the card. Each row here is ``model.generate`` at batch 1 (prompt and new tokens
``--context``/2 each) after a fresh compile (inductor's caches off, so every row tunes again):

* ``default``: the step as users get it (coordinate descent, each candidate timed by its device
  kernel time: ``mhe.generation.step.kernel_time_tuning``);
* ``event-clock``: coordinate descent timed by inductor's own event clock (the default before
  the kernel-time clock), which for these ~3 us kernels reads 5-26 times the kernel's time in
  the step;
* ``off``: ``compile_options={}``, no tuning (inductor then leaves one-row products to cuBLAS).

It prints each row's ms a token, decode step, first call (compile and tuning), kernels and GPU
time a token and the costliest kernels, then the card; ``--tuner-log`` keeps coordinate
descent's own log (each kernel's candidates and pick). ``--repeats`` compiles each (kind,
tuning, kernel) that many times, in turn, so that a pick that varies shows as rows that differ;
``--kernels`` gives each row the decode kernel named (``auto``: the session's own choice);
``--rotations separate,kernel`` a row with the queries and keys rotated each on its own and one
with them rotated, and the keys stacked with the values, by one kernel of mhe's (the rotating
step, ``kv_cache.ROTARY_STEP``; the option's default is the library's setting): apart, GQA
launches one kernel a layer more than MHA at batch 1, its queries' rotation apart from its keys'.
(Two more levers measured here and removed since, the queries and keys rotated as one tensor and
the keys and values written apart, are in docs/benchmarks.md with their rows.)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging
from pathlib import Path

import torch

from decoding import rows as decode_rows
from mhe.attention import kv_cache
from mhe.attention.kernels import check_kernel
from mhe.errors import MheError
from mhe.generation import step as step_module

TUNINGS = ("default", "event-clock", "off")
ROTATIONS = ("separate", "kernel")
TUNER_LOGGER = "torch._inductor.runtime.coordinate_descent_tuner"


@contextlib.contextmanager
def event_clock(on: bool):
    """While the block runs, steps compiled with coordinate descent tune by inductor's own event
    clock (``KERNEL_TIME_TUNING`` off); nothing when ``on`` is false."""
    was = step_module.KERNEL_TIME_TUNING
    step_module.KERNEL_TIME_TUNING = was and not on
    try:
        yield
    finally:
        step_module.KERNEL_TIME_TUNING = was


@contextlib.contextmanager
def switched(module, name: str, on: bool):
    """While the block runs, ``module.name`` is ``on``; back as it was afterwards."""
    was = getattr(module, name)
    setattr(module, name, on)
    try:
        yield
    finally:
        setattr(module, name, was)


def rotating_step(on: bool):
    """A step's queries and keys rotated and its keys and values stacked by one kernel
    (``kv_cache.ROTARY_STEP``)."""
    return switched(kv_cache, "ROTARY_STEP", on)


def compile_options(tuning: str, dev: torch.device) -> dict | None:
    """The ``compile_options`` of a row: None (the default), ``{}`` (no tuning); on a CPU the
    ``aot_eager`` backend for every tuning (no C compiler needed, nothing to tune)."""
    if dev.type == "cpu":
        return {"backend": "aot_eager"}
    return {} if tuning == "off" else None


def one_row(model, ids, mask, dev, tuning: str, new: int, reps: int, top: int, kernel: str = "auto") -> dict:
    """One fresh compile of the batch-1 step under ``tuning`` with the decode ``kernel`` (``auto``:
    the session's own choice): its timings and kernels."""
    from mhe.generation.session import release_default_sessions

    release_default_sessions(model)
    torch._dynamo.reset()
    options = {"step_mode": "compile", "compile_options": compile_options(tuning, dev),
               "kernel": None if kernel == "auto" else kernel}
    with event_clock(tuning == "event-clock"):
        timing = decode_rows.generate_row(model, ids, mask, new, dev, reps, **options)
    count = decode_rows.kernels_per_token(model, ids, mask, dev, top=top, **options)
    return {"ms_a_token": 1e3 * timing["seconds"] / new, "decode_ms_a_step": timing["decode_ms_per_step"],
            "first_call_s": timing["first_call_s"], **count}


def keep_tuner_log(path: str) -> None:
    """Coordinate descent's own debug log (candidates, timings, picks) appended to ``path``."""
    handler = logging.FileHandler(path)
    handler.setLevel(logging.DEBUG)
    logger = logging.getLogger(TUNER_LOGGER)
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)


def print_row(row: dict) -> None:
    print(f"{row['kind']:8s} {row['tuning']:9s} {row['kernel']:14s} {row.get('rotation', 'separate'):8s} "
          f"#{row['repeat']}: {row['ms_a_token']:.4f} ms a token, decode step "
          f"{row['decode_ms_a_step']:.4f} ms, first call {row['first_call_s']:.1f} s, "
          f"{row['kernels_per_token']:.0f} {row['counted']} and {row['busy_us_per_token']:.1f} us busy a token",
          flush=True)
    for k in row.get("top_kernels", []):
        print(f"    {k['us']:8.1f} us {k['launches']:5.1f} x  {k['name']}", flush=True)


def measure(a, tunings: list[str], dev: torch.device, context: int, keep=lambda rows: None) -> list[dict]:
    """Every row: kind x repeat x tuning x kernel, each a fresh compile; ``keep(rows)`` after each
    (a call cut by a time limit keeps the rows it finished)."""
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    rows = []
    for kind in a.kinds.split(","):
        model = decode_rows.build(a.preset, kind, context, dev, dtype, a.smoke)
        ids, mask = decode_rows.prompts(model, 1, context // 2, dev)
        for repeat in range(a.repeats):
            for tuning, kernel, rotation in itertools.product(tunings, a.kernels.split(","),
                                                              a.rotations.split(",")):
                with rotating_step(rotation == "kernel"):
                    timed = one_row(model, ids, mask, dev, tuning, context // 2, a.reps, a.top, kernel)
                row = {"kind": kind, "tuning": tuning, "kernel": kernel, "rotation": rotation,
                       "repeat": repeat, **timed}
                print_row(row)
                rows.append(row)
                keep(rows)
        del model
        decode_rows.release(dev)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="decode.py tuning", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama-135m")
    ap.add_argument("--kinds", default="mha,gqa,mhe-mul")
    ap.add_argument("--tunings", default="default,event-clock,off", help=f"comma-separated, of {', '.join(TUNINGS)}")
    ap.add_argument("--kernels", default="auto", help="comma-separated decode kernels (auto: the session's choice)")
    ap.add_argument("--rotations", default="kernel" if kv_cache.ROTARY_STEP else "separate",
                    help="comma-separated, of separate and kernel: the queries' and keys' rotation "
                         "(kernel: kv_cache.ROTARY_STEP; default: the library's setting)")
    ap.add_argument("--repeats", type=int, default=2,
                    help="fresh compiles of each (kind, tuning, kernel, rotation), in turn")
    ap.add_argument("--context", type=int, default=512, help="prompt + new tokens (half each)")
    ap.add_argument("--reps", type=int, default=5, help="timed calls a row after the first")
    ap.add_argument("--top", type=int, default=4, help="the costliest kernels listed a row")
    ap.add_argument("--tuner-log", default="", help="append coordinate descent's own log to this file")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the tool's plumbing)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    tunings = a.tunings.split(",")
    if bad := [t for t in tunings if t not in TUNINGS]:
        ap.error(f"--tunings: {bad[0]!r} is not one of {', '.join(TUNINGS)}")
    if bad := [r for r in a.rotations.split(",") if r not in ROTATIONS]:
        ap.error(f"--rotations: {bad[0]!r} is not one of {', '.join(ROTATIONS)}")
    for kernel in a.kernels.split(","):
        if kernel != "auto":
            try:
                check_kernel(kernel)
            except MheError as e:
                ap.error(f"--kernels: {e}")
    if a.repeats < 1 or a.reps < 1:
        ap.error(f"--repeats and --reps must be at least 1 (got {a.repeats}, {a.reps})")
    if a.tuner_log:
        keep_tuner_log(a.tuner_log)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    context = 48 if a.smoke else a.context
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"

    def keep(rows):
        if a.json:
            Path(a.json).write_text(json.dumps({"device": card, "preset": a.preset, "rows": rows}, indent=1))
    with torch._inductor.config.patch(force_disable_caches=True):  # every row compiles and tunes afresh
        measure(a, tunings, dev, context, keep)
    print(f"device: {card}; torch {torch.__version__}; {a.preset}, batch 1, context {context}")
    return 0
