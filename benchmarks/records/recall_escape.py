"""When the recall grid's runs left the plateau: does a length's step budget give the slower learners time?

    python benchmarks/results_tools.py recall-escape results/recall-zoology [--archive FILE.tar.xz] [--out FILE.md]

A recall run that has not learned the task sits at a plateau: it knows the answer is one of the
listed values and no more, a training loss of about ln(pairs). A run that learns leaves it
within a few hundred steps. For each run this reads the first logged step whose training loss
is below half of ln(pairs) (``metrics.jsonl``, one record every ``log_every`` steps) and its
test accuracy; per sequence length and width it gives how many runs left the plateau, the
median and latest such step, the latest as a share of the run's steps, and how many ended above
0.9 accuracy. A latest step near the end of the budget says the budget is what decides which
runs learn (issue 60: the first pass of length 256 at 1,200 steps). ``--archive`` reads a packed
set of runs kept beside the grid (``runs-1200-steps.tar.xz``) instead of the grid's own.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path, PurePosixPath

from mhe.experiments.run_archive import RunFiles, read_archive
from mhe.training.run_files import CONFIG, METRICS, RESULTS, parse_metrics

LEARNED = 0.9
"""Test accuracy above which a run counts as having learned the task."""


def escape_step(records: list[dict], pairs: int) -> int | None:
    """The first logged step whose training loss is below half the plateau's, ln(pairs); None if none."""
    bar = math.log(pairs) / 2
    return next((int(r["step"]) for r in records if "loss" in r and "step" in r and r["loss"] < bar), None)


def run_row(config: dict, results: dict, records: list[dict]) -> dict:
    """One run: its length, width, pairs, steps, test accuracy and escape step."""
    run = config["run"]
    pairs = int(run["data"]["task_options"]["pairs"])
    return {"length": int(run["data"]["task_options"]["seq_len"]), "width": int(run["model"]["d_model"]),
            "pairs": pairs, "steps": int(results["steps"]), "score": float(results["score"]),
            "escape": escape_step(records, pairs)}


def folder_rows(folder: Path) -> list[dict]:
    """The finished runs of a grid folder (``runs/`` or ``runs.tar.xz``)."""
    files = RunFiles(folder)
    return [run_row(files.config(name), files.results(name), files.metrics(name) or [])
            for name in files.finished()]


def archive_rows(path: Path) -> list[dict]:
    """The finished runs of an archive whose members are ``PREFIX/RUN/FILE``."""
    members = read_archive(path)
    runs = sorted({PurePosixPath(n).parts[1] for n in members if n.endswith("/" + RESULTS)})
    rows = []
    for name in runs:
        prefix = next(n for n in members if PurePosixPath(n).parts[1] == name).split("/")[0]
        read = lambda f: members.get(f"{prefix}/{name}/{f}")  # noqa: E731
        metrics = read(METRICS)
        rows.append(run_row(json.loads(read(CONFIG)), json.loads(read(RESULTS)),
                            parse_metrics(metrics, where=f"{path}:{name}") if metrics else []))
    return rows


def table(rows: list[dict]) -> str:
    """Per length and width: runs, how many left the plateau, median and latest escape step, the
    latest as a share of the steps, runs above ``LEARNED`` accuracy."""
    lines = ["| length | pairs | width | steps | runs | left the plateau | median step | latest step | "
             "latest, of the steps | above 0.9 |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    cells = sorted({(r["length"], r["width"]) for r in rows}, key=lambda c: (c[0], -c[1]))
    for length, width in cells:
        mine = [r for r in rows if (r["length"], r["width"]) == (length, width)]
        steps = max(r["steps"] for r in mine)
        left = [r["escape"] for r in mine if r["escape"] is not None]
        median, latest = (f"{statistics.median(left):.0f}", max(left)) if left else ("-", None)
        share = f"{latest / steps:.0%}" if latest is not None else "-"
        lines.append(f"| {length} | {mine[0]['pairs']} | {width} | {steps:,} | {len(mine)} | {len(left)} | {median} | "
                     f"{latest if latest is not None else '-'} | {share} | "
                     f"{sum(r['score'] > LEARNED for r in mine)} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="results_tools.py recall-escape", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a recall grid's folder (runs/ or runs.tar.xz)")
    ap.add_argument("--archive", type=Path, help="read this archive of runs (PREFIX/RUN/FILE members) instead")
    ap.add_argument("--out", type=Path, help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    if a.archive is not None and not a.archive.is_file():
        ap.error(f"--archive {a.archive}: no such file")
    rows = archive_rows(a.archive) if a.archive else folder_rows(a.folder)
    if not rows:
        ap.error(f"{a.archive or a.folder}: no finished runs")
    text = table(rows)
    print(text)
    if a.out:
        from mhe.training.atomic import write_text_atomic

        write_text_atomic(a.out, text + "\n")
    return 0
