"""How long a recall grid's runs took, per cell, by their own clocks: what a call of the grid holds.

    python benchmarks/results_tools.py recall-times results/recall-zoology [--log FILE --calls A[-B]]
        [--out FILE.md]

Each finished run records its wall clock (``results.json``'s ``wall_clock``: ``steps_s``, the
training steps alone, and ``total_s``, the run with its start-up, compilation and evaluations).
Per sequence length and width this gives the runs, the median and range of the milliseconds a
step took in each process (``steps_s`` over the steps) and of the seconds a run took. Pooled runs
share a card, so a step's time depends on what else ran beside it (the number of workers a card,
MPS, the widths in the pool): ``--log`` with ``--calls`` keeps the runs that the given calls of a
run-book's console finished (a call begins at a line starting with ``+ ``, the run-book's header
or a probe's note, and names each finished run on a ``[done] NAME: score`` line; calls count from 1 in the log's
order), so that the figures of one setting are read apart. A run's name says nothing of its
settings, so a run trained again (a pass superseded by more steps) belongs to the last call that
finished it, the one whose run the folder holds; and a call whose header names another grid than
the folder's ``grid.json`` (a probe's preset) holds none of the folder's runs. A run resumed from
a checkpoint records its last process only, so its step time counts that part (the grid's runs
cut by a deadline all started again from their first step).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

from mhe.experiments.run_archive import RunFiles
from records import emit, guarded

CELL = re.compile(r"L(\d+)-d(\d+)-")
"""The start of a grid run's name (``Point.name``): its sequence length and width."""
DONE = "[done] "
"""How a run-book's console names a finished run: ``[done] NAME: score``."""


def calls_of(log: Path) -> list[tuple[str, list[str]]]:
    """Each call of a run-book's console: its header line and the names of the runs it finished."""
    calls: list[tuple[str, list[str]]] = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("+ "):
            calls.append((line, []))
        elif line.startswith(DONE) and calls:
            calls[-1][1].append(line[len(DONE):].split(":")[0].strip())
    return calls


def runs_of_calls(calls: list[tuple[str, list[str]]], chosen: range, grid: str | None) -> set[str]:
    """The runs whose last finishing call of ``grid`` (a call whose header names it in brackets, as
    the run-book writes ``(PRESET)``; every call when ``grid`` is None) lies in ``chosen``."""
    last: dict[str, int] = {}
    for i, (header, names) in enumerate(calls):
        if grid is None or f"({grid})" in header:
            last.update(dict.fromkeys(names, i))
    return {name for name, i in last.items() if i in chosen}


def grid_name(folder: Path) -> str | None:
    """The grid a folder holds, from its ``grid.json`` (None without one)."""
    try:
        return json.loads((folder / "grid.json").read_text())["grid"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def call_range(text: str, count: int) -> range:
    """``A`` or ``A-B`` (1-based, inclusive) as a range of call indices; ValueError past the log's
    ``count`` calls or for anything else."""
    m = re.fullmatch(r"(\d+)(?:-(\d+))?", text)
    first, last = (int(m[1]), int(m[2] or m[1])) if m else (0, 0)
    if not m or not 1 <= first <= last:
        raise ValueError(f"--calls {text!r}: give A or A-B, calls counted from 1")
    if last > count:
        raise ValueError(f"--calls {text}: the log has {count} call(s)")
    return range(first - 1, last)


def cell_times(folder: Path, names: set[str] | None = None) -> dict[tuple[int, int], list[tuple[float, float]]]:
    """Per (length, width): each finished run's (milliseconds a step, seconds a run), of the runs
    in ``names`` if given; a run without a clock (an older layout) is left out."""
    files, cells = RunFiles(folder), {}
    for name in files.finished():
        m = CELL.match(name)
        if m is None or (names is not None and name not in names):
            continue
        results = files.results(name)
        clock, steps = results.get("wall_clock"), results.get("steps")
        if steps and isinstance(clock, dict) and clock.get("steps_s") is not None and clock.get("total_s") is not None:
            per_step = 1000 * float(clock["steps_s"]) / int(steps)
            cells.setdefault((int(m[1]), int(m[2])), []).append((per_step, float(clock["total_s"])))
    return cells


def table(cells: dict[tuple[int, int], list[tuple[float, float]]]) -> str:
    """A line per length and width (the wider first): runs, and the median and range of the
    milliseconds a step and of the seconds a run."""
    lines = ["| length | width | runs | ms a step, median | range | s a run, median | range |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for length, width in sorted(cells, key=lambda c: (c[0], -c[1])):
        ms, seconds = zip(*cells[(length, width)])
        lines.append(f"| {length} | {width} | {len(ms)} | {statistics.median(ms):.1f} | {min(ms):.1f}-{max(ms):.1f} | "
                     f"{statistics.median(seconds):.0f} | {min(seconds):.0f}-{max(seconds):.0f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="results_tools.py recall-times", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a recall grid's folder (runs/ or runs.tar.xz)")
    ap.add_argument("--log", type=Path, help="a run-book's console (results/logs/i60-recall.log)")
    ap.add_argument("--calls", help="with --log: the runs these calls finished, A or A-B (from 1)")
    ap.add_argument("--out", type=Path, help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    if (a.log is None) != (a.calls is None):
        ap.error("--log and --calls go together")
    return guarded(ap, lambda: report(ap, a))


def report(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """The table of the folder's runs, or of those the chosen calls finished, printed and written
    to ``--out``."""
    names = None
    if a.log is not None:
        if not a.log.is_file():
            ap.error(f"--log {a.log}: no such file")
        calls = calls_of(a.log)
        names = runs_of_calls(calls, call_range(a.calls, len(calls)), grid_name(a.folder))
    cells = cell_times(a.folder, names)
    if not cells:
        among = f" among calls {a.calls}" if names is not None else ""
        ap.error(f"{a.folder}: no finished runs with a clock{among}")
    return emit(table(cells), a.out)
