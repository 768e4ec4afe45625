"""A run of the recall grid (issue 60) timed alone and N at once on one card: what its step costs.

    python benchmarks/train_bench.py recall-step                   # 3 cells, eager and compiled, 1 and 8 processes
    python benchmarks/train_bench.py recall-step --profile         # and each row's kernels and GPU busy time a step
    python benchmarks/train_bench.py recall-step --mps no,yes      # the concurrent rows also under NVIDIA's MPS daemon
    python benchmarks/train_bench.py recall-step --compiled yes,graphs  # compiled, and replayed as CUDA graphs
    python benchmarks/train_bench.py recall-step --cpu-smoke       # the cpu-recall-zoology grid, a few steps, a CPU

Each row trains the grid preset's configuration of one cell (sequence length, width) and entry,
as ``mhe compare --preset gpu-recall-zoology`` would (seed 0, learning rate 3e-3), for ``--steps``
steps logged in 5 intervals. A step's time is the median of the intervals after the first
(``step_s`` of the run's ``metrics.jsonl``; each interval ends where the trainer reads the loss),
so start-up, compilation and the final evaluation drop out. (An earlier form took the difference
of two runs in one process, which a compiled row skews: the second run compiles again.) With N processes the same run trains in N
processes at once on the card, as the grid's pooled workers share it; the card's time a step is
then a process's time a step / N, and set beside one process's it says whether more workers a
GPU buy throughput; ``--mps yes`` runs them once more with NVIDIA's MPS daemon started for
them (processes share the card's SMs instead of taking turns on it). ``--profile`` adds, from one process alone, the device kernels a step, the
GPU's busy time a step (against the wall time: the rest is the host's or the card's idle time)
and the kernels that take the most time. The table names the card; ``--json`` keeps the rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from toolbox import BENCHMARKS

CELLS = "64:64,128:512,512:512"


def grid_point(grid_name: str, length: int, width: int, entry: str):
    """The grid and its run of ``entry`` (``BLOCK:ENTRY`` names the block, e.g. ``rotary:mha``;
    else the first block holding it) at the cell of sequence length ``length`` and ``width``
    (seed 0, learning rate 3e-3)."""
    from mhe.experiments.grid import Point
    from mhe.experiments.grid_presets import GRIDS

    grid = GRIDS[grid_name]
    named, _, name = entry.rpartition(":")
    block = next((b for b in grid.blocks if name in b.entries and named in ("", b.name)), None)
    cells = dict(grid.cells)
    if block is None or length not in cells:
        entries = [entry_label(b.name, e) for b in grid.blocks for e in b.entries]
        raise SystemExit(f"recall-step: grid {grid_name} has no entry {entry!r} at length {length}; entries "
                         f"{entries}, lengths {sorted(cells)}")
    return grid, Point(block, name, length, cells[length], width, 3e-3, 0)


def entry_label(block: str, entry: str) -> str:
    """``BLOCK:ENTRY``, or ``ENTRY`` alone for the grid's unnamed (first) block."""
    return f"{block}:{entry}" if block else entry


INTERVALS = 5
"""Log intervals of a timed run: the first holds start-up and compilation, the rest are timed."""


def train_once(grid, point, steps: int, compiled: bool | str) -> tuple[float, float]:
    """One run of ``steps`` steps in this process: its steady milliseconds a step
    (:func:`steady_step_ms`) and its test accuracy."""
    from mhe.experiments.grid import run_config
    from mhe.tasks.runs import run_training
    from mhe.training.run_files import METRICS, read_metrics

    cfg = run_config(grid, point, [f"train.steps={steps}", *compile_settings(compiled),
                                   f"train.warmup_steps={max(1, steps // 10)}",
                                   f"train.log_every={max(1, steps // INTERVALS)}"])
    with tempfile.TemporaryDirectory() as d:
        res = run_training(cfg, Path(d) / "run", False, log=lambda m: None)
        if "score" not in res:  # interrupted (a signal, a time limit), stopped early or failed: no clock to trust
            raise SystemExit(f"recall-step: the run of {steps} steps ended {res.get('status', 'without a status')!r}, "
                             "not done")
        records = read_metrics(Path(d) / "run" / METRICS)
    return steady_step_ms(records), res["score"]


def compile_settings(compiled: bool | str) -> list[str]:
    """``--compiled``'s choice as settings: eager, compiled, or compiled and replayed as CUDA graphs
    (``graphs``: ``train.cuda_graphs=true``; recall's batches have one shape, but the task does not
    declare it, so the grid's ``auto`` leaves graphs off)."""
    graphs = ["train.cuda_graphs=true"] if compiled == "graphs" else []
    return [f"train.compile={str(bool(compiled)).lower()}", *graphs]


def compiled_label(compiled: bool | str) -> str:
    return "graphs" if compiled == "graphs" else "yes" if compiled else "no"


def steady_step_ms(records: list[dict]) -> float:
    """The median ``step_s`` (in ms) of a run's log intervals after its first, which holds the
    start-up and the compilation."""
    clocks = [r["step_s"] for r in records if "step_s" in r]
    if len(clocks) < 2:
        raise SystemExit(f"recall-step: the run logged {len(clocks)} interval(s) of steps, fewer than the 2 a "
                         "timing needs")
    return 1e3 * statistics.median(clocks[1:])


def train_clock(spec: dict) -> dict:
    """A step's milliseconds (the steady intervals of one run) and the run's test accuracy."""
    grid, point = grid_point(spec["grid"], spec["length"], spec["width"], spec["entry"])
    ms, score = train_once(grid, point, spec["steps"], spec["compiled"])
    return {"ms_a_step": ms, "accuracy": score}


def profile_clock(spec: dict, top: int) -> dict:
    """One run of the spec's steps under torch's profiler: device kernels and GPU busy time a step
    (start-up and the final evaluation counted in, a few kernels), the ``top`` kernels by time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    grid, point = grid_point(spec["grid"], spec["length"], spec["width"], spec["entry"])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        train_once(grid, point, spec["steps"], spec["compiled"])
    return kernel_table(prof.events(), spec["steps"], top)


def kernel_table(events, n: int, top: int) -> dict:
    """Device kernels and GPU busy time a step over ``n`` steps from a profiler's events, the
    ``top`` kernels by time; ranges the code marks on the GPU's timeline (user annotations, such
    as the optimiser's step) are spans, not kernels, and are left out."""
    kernels: dict[str, list] = {}
    for e in events:
        if e.device_type.name == "CUDA" and not e.is_user_annotation:
            k = kernels.setdefault(e.name[:80], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels_a_step": sum(v[0] for v in kernels.values()) / n,
            "gpu_busy_ms_a_step": sum(v[1] for v in kernels.values()) / 1e3 / n,
            "top_kernels": [{"name": k, "a_step": c / n, "us_a_step": t / n} for k, (c, t) in ranked]}


def run_processes(spec: dict, n: int, argv_tail: list[str], env: dict[str, str]) -> list[dict]:
    """``n`` children training ``spec`` at once (``env`` added to theirs); each one's JSON row,
    the last line of its output that is one."""
    from mhe.runtime import worker_threads

    tool = [sys.executable, str(BENCHMARKS / "train_bench.py"), "recall-step", "--child", json.dumps(spec)]
    threads = str(worker_threads(n))  # the pool's share of the cores: N processes of 8 threads would fight
    procs = [subprocess.Popen([*tool, *argv_tail], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1", "MHE_THREADS": threads,
                                   "OMP_NUM_THREADS": threads, **env}) for _ in range(n)]
    outs = [p.communicate()[0] for p in procs]
    rows = [[line for line in o.splitlines() if line.startswith("{")] for o in outs]
    if any(p.returncode for p in procs) or not all(rows):
        raise SystemExit(f"recall-step: a child failed for {spec} (exit codes {[p.returncode for p in procs]})")
    return [json.loads(r[-1]) for r in rows]


MPS = "nvidia-cuda-mps-control"


@contextlib.contextmanager
def mps_daemon(on: bool):
    """NVIDIA's MPS control daemon running (its pipes in a folder of its own, which the children
    inherit through the environment) while the block runs; nothing when ``on`` is false."""
    if not on:
        yield
        return
    folder = Path(tempfile.mkdtemp(prefix="mps-"))
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    saved = {k: os.environ.get(k) for k in env}
    started = False
    try:
        os.environ.update(env)
        subprocess.run([MPS, "-d"], check=True)
        started = True
        yield
    finally:
        if started:
            subprocess.run([MPS], input="quit\n", text=True, check=False)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        shutil.rmtree(folder, ignore_errors=True)


def rows_of(a, keep=lambda rows: None) -> list[dict]:
    """Every row: cell x entry x compiled x (MPS) x processes, in that order (MPS only for
    concurrent processes: one process alone has the card either way); ``keep(rows)`` after each
    row, so that a run cut short keeps the rows it finished."""
    rows = []
    for cell in a.cells.split(","):
        length, width = (int(x) for x in cell.split(":"))
        for entry in a.entries.split(","):
            for compiled in a.compiled:
                point = grid_point(a.grid, length, width, entry)[1]  # the entry as BLOCK:ENTRY, checked here
                spec = dict(grid=a.grid, length=length, width=width, entry=entry_label(point.block.name, point.entry),
                            compiled=compiled, steps=a.steps)
                for mps, n in [(m, n) for m in a.mps for n in a.concurrent if n > 1 or not m]:
                    with mps_daemon(mps):
                        got = run_processes(spec, n, ["--profile", "--top", str(a.top)] if a.profile and n == 1 else [],
                                            a.child_env)
                    ms = sum(g["ms_a_step"] for g in got) / n
                    rows.append({**spec, "mps": mps, "processes": n, "ms_a_step": ms, "card_ms_a_step": ms / n,
                                 "accuracy": got[0]["accuracy"],
                                 **{k: v for k, v in got[0].items() if k not in ("ms_a_step", "accuracy")}})
                    print(f"  {cell} {entry} compiled={compiled} mps={mps} x{n}: {ms:.2f} ms a step a process, "
                          f"{ms / n:.2f} of the card{profile_line(rows[-1])}", flush=True)
                    keep(rows)
    return rows


def profile_line(row: dict) -> str:
    """A profiled row's GPU busy time and kernels a step and its costliest kernels, for the console."""
    if "gpu_busy_ms_a_step" not in row:
        return ""
    top = "; ".join(f"{k['name'][:48]} {k['us_a_step']:.0f} us" for k in row["top_kernels"])
    return f"; GPU busy {row['gpu_busy_ms_a_step']:.2f} ms, {row['kernels_a_step']:.0f} kernels a step; top: {top}"


def table(rows: list[dict], card: str) -> str:
    lines = [f"card: {card}", "",
             "| length | width | entry | compiled | MPS | processes | ms a step, a process | ms a step, of the card "
             "| GPU busy ms a step | kernels a step | accuracy |",
             "|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        busy = f"{r['gpu_busy_ms_a_step']:.2f}" if "gpu_busy_ms_a_step" in r else "-"
        kern = f"{r['kernels_a_step']:.0f}" if "kernels_a_step" in r else "-"
        lines.append(f"| {r['length']} | {r['width']} | {r['entry']} | {compiled_label(r['compiled'])} | "
                     f"{'yes' if r.get('mps') else 'no'} | {r['processes']} | {r['ms_a_step']:.2f} | {r['card_ms_a_step']:.2f} | {busy} | {kern} | "
                     f"{r['accuracy']:.3f} |")
    return "\n".join(lines)


def card_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU (CPU)"


def child(spec: dict, top: int) -> int:
    """A child process: the spec's step clock (and, with ``top``, its profile) as one JSON line."""
    row = train_clock(spec)
    if top:
        row.update(profile_clock(spec, top))
    print(json.dumps(row), flush=True)
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="train_bench.py recall-step", description=__doc__.split("\n")[0])
    ap.add_argument("--grid", default="gpu-recall-zoology", help="a grid preset of mhe compare")
    ap.add_argument("--cells", default=CELLS, help="LENGTH:WIDTH,... (default %(default)s)")
    ap.add_argument("--entries", default="mha", help="grid entries, comma-separated, each ENTRY or BLOCK:ENTRY "
                                                     "(e.g. mha,mhe-mul,rotary:mha; ENTRY alone: its first block)")
    ap.add_argument("--compiled", default="no,yes", help="comma-separated, of no, yes (train.compile) and graphs "
                                                         "(compiled and replayed as CUDA graphs)")
    ap.add_argument("--concurrent", help="processes training at once on the card (default 1,8; --cpu-smoke 1,2)")
    ap.add_argument("--mps", default="no", help="no, yes or no,yes: the concurrent rows under NVIDIA's MPS daemon")
    ap.add_argument("--steps", type=int, default=150, help="steps of each timed run, logged in 5 intervals (the first untimed)")
    ap.add_argument("--profile", action="store_true", help="each one-process row also profiled (kernels, GPU time)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed by --profile")
    ap.add_argument("--json", type=Path, help="the rows as JSON")
    ap.add_argument("--cpu-smoke", action="store_true", help="the cpu-recall-zoology grid, 10 steps, a CPU")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(json.loads(a.child), a.top if a.profile else 0)
    a.child_env = {}
    if a.cpu_smoke:  # its own grid, cell, steps and eager steps, whatever else was given
        a.grid, a.cells, a.steps, a.compiled = "cpu-recall-zoology", "32:32", 10, "no"
        a.concurrent = a.concurrent or "1,2"
        a.child_env = {"CUDA_VISIBLE_DEVICES": ""}  # the children's alone: this process keeps its own
    a.concurrent = a.concurrent or "1,8"
    choice = {"no": False, "yes": True}
    try:
        compiled = [{**choice, "graphs": "graphs"}[c] for c in a.compiled.split(",")]
        mps = [choice[c] for c in a.mps.split(",")]
        concurrent = [int(n) for n in a.concurrent.split(",")]
    except (KeyError, ValueError):
        ap.error(f"--compiled takes no, yes and graphs, --mps no, yes or no,yes (got {a.compiled!r}, {a.mps!r}); "
                 f"--concurrent takes "
                 f"counts (got {a.concurrent!r})")
    a.compiled, a.mps, a.concurrent = compiled, mps, concurrent
    if any(a.mps) and max(a.concurrent) < 2:
        ap.error(f"--mps yes runs only rows of several processes at once; --concurrent {a.concurrent} has none")
    if any(a.mps) and shutil.which(MPS) is None:
        ap.error(f"--mps yes needs {MPS} (NVIDIA's MPS daemon) on PATH; it is not on this machine")
    if a.steps < 5 or min(a.concurrent) < 1:
        ap.error(f"--steps must be at least 5 (got {a.steps}) and --concurrent at least 1 (got {a.concurrent})")
    card = "no GPU (CPU)" if a.cpu_smoke else card_name()

    def keep(rows):
        if a.json:
            from mhe.training.atomic import write_text_atomic

            write_text_atomic(a.json, json.dumps({"card": card, "rows": rows}, indent=1))
    print(table(rows_of(a, keep), card))
    return 0
