"""When the recall grid's runs left the plateau: does a length's step budget give the slower learners time?

    python benchmarks/results_tools.py recall-escape results/recall-zoology [--archive FILE.tar.xz [--per-run]]
        [--out FILE.md]
    python benchmarks/results_tools.py recall-escape results/recall-zoology --by-entry [--length N] [--out FILE.md]

A recall run that has not learned the task sits at a plateau: it knows at best that the answer
is one of the listed values, a training loss of ln(pairs) or above. A run that learns leaves it
within a few hundred steps. For each run this reads the first logged step whose training loss
is below half of ln(pairs) (``metrics.jsonl``, one record every ``log_every`` steps) and its
test accuracy. A run whose loss fell so but whose test accuracy ended at or under
``GENERALISED`` memorised its training sequences (its loss falls at epoch boundaries) and is
counted apart, not as having left. Per sequence length, width and step budget it gives the runs,
how many left the plateau, the median and latest step at which they did, the latest as a share
of the budget, how many memorised, and how many ended above 0.9 accuracy. A latest step near the
end of the budget says the budget decides which runs learn (issue 60: the first pass of length
256 at 1,200 steps). For the runs that did not leave, it gives their lowest last logged loss, how
many had not even reached the plateau's ln(pairs) by the end, and how many were still falling
(their last loss more than ``FALLING``, relative, under the one logged at 80% of the steps;
memorised runs are not among them), and the median share of their fall after 20% of the steps
that came in the logged intervals where a new epoch of the training sequences began, beside the
share of such intervals (what a fall blind to epochs would give): a cell whose runs are short of
the plateau and falling, but not at epoch starts, was cut early; one whose fall comes at epoch
starts is memorising its training sequences, and more steps over them feed that path (length 512
at 4,500 and 9,000 steps). ``--archive`` reads a packed set of runs kept beside the grid
(``runs-1200-steps.tar.xz``) instead of the grid's own; with ``--per-run`` it lists each of its
runs, those cut before their end too (a probe's runs stopped by a call's deadline: length 512 at
35,000 steps), with the steps they logged, their last and lowest loss and their fall at epoch
starts. ``--by-entry`` reads the grid's folder a line per length, width and entry instead: the
best rate (seed 0's best test accuracy, as ``mhe report`` picks it), each seed's test accuracy and
last logged training loss there, and the last losses at the other rates, which say how far each
kind got where no run leaves the plateau (length 512; ``--length`` keeps one length).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
from pathlib import Path, PurePosixPath

from mhe.experiments.grid import best_lr
from mhe.experiments.run_archive import RunFiles, read_archive
from mhe.training.run_files import CONFIG, METRICS, RESULTS, parse_metrics
from records import emit, guarded

LEARNED = 0.9
"""Test accuracy above which a run counts as having learned the task."""
GENERALISED = 0.5
"""Test accuracy a run whose training loss left the plateau must end above to count as having
left it (at or under it, the fall was memorisation: plateaus lie at 1/pairs, 0.25 and below)."""
FALLING = 0.01
"""Relative drop of the training loss over the last fifth of the steps above which a run counts as
still falling at the end."""
SETTLED = 0.2
"""Share of the steps after which a run's fall is read for epoch starts (warm-up and the first
descent from ln(vocabulary) lie before it)."""
RUN_NAME = re.compile(r"L(\d+)-d(\d+)-(.+)-lr([0-9.e+-]+)-seed(\d+)")
"""How the grid names a run (``Point.name``): length, width, entry, learning rate, seed."""


def escape_step(records: list[dict], pairs: int) -> int | None:
    """The first logged step whose training loss is below half the plateau's, ln(pairs); None if none."""
    bar = math.log(pairs) / 2
    return next((int(r["step"]) for r in records if "loss" in r and "step" in r and r["loss"] < bar), None)


def end_losses(records: list[dict], steps: int) -> tuple[float | None, float | None]:
    """The last logged training loss and the last one logged at or before 80% of ``steps``."""
    losses = [(int(r["step"]), float(r["loss"])) for r in records if "loss" in r and "step" in r]
    early = [x for step, x in losses if step <= 0.8 * steps]
    return (losses[-1][1] if losses else None), (early[-1] if early else None)


def epoch_share(records: list[dict], steps: int, epoch: int | None,
                per_step: int = 1) -> tuple[float, float] | None:
    """Of the training loss's fall from the first step logged at ``SETTLED`` of ``steps`` to the
    last: the share that came in the logged intervals in which a new epoch began, and the share of
    the intervals that are such. An epoch is ``epoch`` batches and a step takes ``per_step``
    (gradient accumulation), so logged step ``s`` (steps done) last took batch ``s * per_step``,
    of epoch ``(s * per_step - 1) // epoch``, as :class:`~mhe.training.batches.BatchOrder` counts.
    None without the epoch's length or a fall of more than ``FALLING`` (relative)."""
    losses = [(int(r["step"]), float(r["loss"])) for r in records if "loss" in r and "step" in r]
    losses = [(step, x) for step, x in losses if step >= SETTLED * steps]
    if not epoch or len(losses) < 2 or losses[-1][1] >= (1 - FALLING) * losses[0][1]:
        return None
    of = [(step * per_step - 1) // epoch for step, _ in losses]
    starts = [later > earlier for earlier, later in zip(of, of[1:])]
    at_starts = sum(x0 - x1 for (_, x0), (_, x1), new in zip(losses, losses[1:], starts) if new)
    return at_starts / (losses[0][1] - losses[-1][1]), sum(starts) / len(starts)


def run_settings(name: str, config: dict | None) -> tuple[dict, dict, dict, int | None]:
    """A run's settings from its ``config.json``: the run record, its task options, its training
    settings and its epoch in batches (training sequences over the batch; None where either is
    not recorded). A run without a readable configuration is a ValueError (a one-line error of the
    command)."""
    if not isinstance(config, dict) or not isinstance(config.get("run"), dict):
        raise ValueError(f"run {name} has no readable config.json")
    run = config["run"]
    options, train = run["data"]["task_options"], run.get("train", {})
    size, batch = options.get("train_size"), train.get("batch_size")
    return run, options, train, (int(size) // int(batch) if size and batch else None)


def run_row(name: str, config: dict | None, results: dict, records: list[dict] | None) -> dict:
    """One run: its length, width, pairs, steps, test accuracy, the step its training loss fell
    under half the plateau's (None if never, or with no metrics), whether that generalised, and
    its last logged loss and the one at 80% of the steps, and how much of its late fall came at
    epoch starts (:func:`epoch_share`)."""
    run, options, train, epoch = run_settings(name, config)
    pairs = int(options["pairs"])
    fell = escape_step(records or [], pairs)
    score, steps = float(results["score"]), int(results["steps"])
    end, at_80 = end_losses(records or [], steps)
    return {"length": int(options["seq_len"]), "width": int(run["model"]["d_model"]), "pairs": pairs,
            "steps": steps, "score": score, "logged": records is not None,
            "escape": fell if fell is not None and score > GENERALISED else None,
            "memorised": fell is not None and score <= GENERALISED, "end_loss": end, "loss_at_80": at_80,
            "epoch_share": epoch_share(records or [], steps, epoch, int(train.get("grad_accum") or 1))}


def folder_rows(folder: Path) -> list[dict]:
    """The finished runs of a grid folder (``runs/`` or ``runs.tar.xz``)."""
    files = RunFiles(folder)
    return [run_row(name, files.config(name), files.results(name), files.metrics(name)) for name in files.finished()]


def archive_runs(path: Path) -> list[tuple[str, dict | None, dict | None, list[dict] | None]]:
    """Every run of an archive of run folders (each run: the folder holding its ``config.json`` or
    ``results.json``, not inside another such folder, so that a run's own subfolders such as
    ``best/`` are not read as runs), finished or not: its name, configuration, results (None if it
    was cut before its end) and metrics records (None where it has none)."""
    members = read_archive(path)
    found = {PurePosixPath(n).parent for n in members if PurePosixPath(n).name in (CONFIG, RESULTS)}
    folders = sorted(f for f in found if not any(up in found for up in f.parents))  # not a run's own subfolders
    runs = []
    for folder in map(str, folders):
        config, results = members.get(f"{folder}/{CONFIG}"), members.get(f"{folder}/{RESULTS}")
        metrics = members.get(f"{folder}/{METRICS}")
        results = json.loads(results) if results else None
        if results is not None and not isinstance(results, dict):
            raise ValueError(f"{path}:{folder}/{RESULTS} is not a JSON object")
        runs.append((PurePosixPath(folder).name, json.loads(config) if config else None, results,
                     parse_metrics(metrics, where=f"{path}:{folder}") if metrics is not None else None))
    return runs


def archive_rows(path: Path) -> list[dict]:
    """The finished runs of an archive of run folders (:func:`archive_runs`)."""
    return [run_row(name, config, results, records)
            for name, config, results, records in archive_runs(path) if results is not None]


def per_run_table(runs: list[tuple[str, dict | None, dict | None, list[dict] | None]]) -> str:
    """A line a run, finished or cut: the steps it logged of its budget, its test accuracy (none
    for a cut run), its last and lowest logged training loss, and the share of its fall after
    ``SETTLED`` of the budget that came at epoch starts (:func:`epoch_share`), so that a run cut
    before its end still says how far it got and how."""
    lines = ["| run | steps logged | of | test accuracy | last loss | lowest loss | "
             "fall at epoch starts (of the intervals) |", "|---|---:|---:|---:|---:|---:|---:|"]
    for name, config, results, records in runs:
        _, _, train, epoch = run_settings(name, config)
        if not results and "steps" not in train:
            raise ValueError(f"run {name} was cut and its config.json gives no train.steps")
        budget = int(results["steps"]) if results else int(train["steps"])
        losses = [(int(r["step"]), float(r["loss"])) for r in records or [] if "loss" in r and "step" in r]
        share = epoch_share(records or [], budget, epoch, int(train.get("grad_accum") or 1))
        accuracy = f"{float(results['score']):.4f}" if results else "cut"
        last, lowest = (f"{losses[-1][1]:.3f}", f"{min(x for _, x in losses):.3f}") if losses else ("-", "-")
        at_starts = f"{share[0]:.0%} ({share[1]:.0%})" if share else "-"
        lines.append(f"| {name} | {losses[-1][0] if losses else 0:,} | {budget:,} | {accuracy} | {last} | "
                     f"{lowest} | {at_starts} |")
    return "\n".join(lines)


def stayed(mine: list[dict]) -> tuple[str, int, int, str]:
    """Of a cell's runs that did not leave the plateau (nor memorised): their lowest last loss, how
    many ended above the plateau's ln(pairs), how many were still falling at the end, and the
    median share of their late fall that came at epoch starts, with the intervals' share beside it."""
    rest = [r for r in mine if r["escape"] is None and not r["memorised"] and r["end_loss"] is not None]
    if not rest:
        return "-", 0, 0, "-"
    above = sum(r["end_loss"] > math.log(r["pairs"]) for r in rest)
    falling = sum(r["loss_at_80"] is not None and r["end_loss"] < (1 - FALLING) * r["loss_at_80"] for r in rest)
    shares = [r["epoch_share"] for r in rest if r["epoch_share"] is not None]
    at_starts = (f"{statistics.median(s for s, _ in shares):.0%} of {len(shares)} "
                 f"({statistics.median(c for _, c in shares):.0%})" if shares else "-")
    return f"{min(r['end_loss'] for r in rest):.2f}", above, falling, at_starts


def table(rows: list[dict]) -> str:
    """Per length, width and step budget: runs, how many left the plateau, the median and latest
    step they did, the latest as a share of the budget, how many memorised, runs above ``LEARNED``,
    and of the rest (:func:`stayed`) the lowest last loss, how many ended above the plateau's loss
    and how many were still falling, and the median share of their late fall at epoch starts."""
    lines = ["| length | pairs | width | steps | runs | left the plateau | median step | latest step | "
             "latest, of the steps | memorised | above 0.9 | the rest: lowest last loss | above ln(pairs) | "
             "falling | late fall at epoch starts (of the intervals) |", "|---:" * 15 + "|"]
    cells = sorted({(r["length"], r["width"], r["steps"]) for r in rows}, key=lambda c: (c[0], -c[1], c[2]))
    for length, width, steps in cells:
        mine = [r for r in rows if (r["length"], r["width"], r["steps"]) == (length, width, steps)]
        left = [r["escape"] for r in mine if r["escape"] is not None]
        median, latest, share = ((f"{statistics.median(left):,.0f}", f"{max(left):,}", f"{max(left) / steps:.0%}")
                                 if left else ("-", "-", "-"))
        unlogged = sum(not r["logged"] for r in mine)
        runs = f"{len(mine)}" + (f" ({unlogged} without metrics)" if unlogged else "")
        lowest, above, falling, at_starts = stayed(mine)
        lines.append(f"| {length} | {mine[0]['pairs']} | {width} | {steps:,} | {runs} | {len(left)} | {median} | "
                     f"{latest} | {share} | {sum(r['memorised'] for r in mine)} | "
                     f"{sum(r['score'] > LEARNED for r in mine)} | {lowest} | {above} | {falling} | {at_starts} |")
    return "\n".join(lines)


def entry_groups(folder: Path, length: int | None = None) -> dict[tuple[int, int, str], dict[float, list]]:
    """The finished runs of a grid folder by (length, width, entry), then by learning rate: each
    run's (seed, test accuracy, last logged training loss or None), read from its name (the entry
    as the name spells it: ``rotary-mha``), its ``results.json`` and its ``metrics.jsonl``;
    ``length`` keeps that length only. A name the grid would not give is a ValueError."""
    files, groups = RunFiles(folder), {}
    for name in files.finished():
        m = RUN_NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"run {name} is not named as the grid names its runs "
                             "(L<length>-d<width>-<entry>-lr<rate>-seed<seed>)")
        if length is not None and int(m[1]) != length:
            continue
        losses = [float(r["loss"]) for r in files.metrics(name) or [] if r.get("loss") is not None]
        run = (int(m[5]), float(files.results(name)["score"]), losses[-1] if losses else None)
        groups.setdefault((int(m[1]), int(m[2]), m[3]), {}).setdefault(float(m[4]), []).append(run)
    return groups


def entry_table(groups: dict[tuple[int, int, str], dict[float, list]]) -> str:
    """A line per length, width and entry (:func:`entry_groups`): the best rate by seed 0's test
    accuracy (:func:`mhe.experiments.grid.best_lr`, as the grid's summary picks it), each seed's
    accuracy and last loss there, and the range of last losses at the other rates with their count
    (every seed run there, runs without a logged loss left out)."""
    lines = ["| length | width | entry | best lr | seeds | test accuracy, each seed | last loss, each seed | "
             "last loss at the other rates |", "|---:|---:|---|---:|---:|---|---|---|"]
    for length, width, entry in sorted(groups, key=lambda k: (k[0], -k[1], k[2])):
        by_lr = groups[(length, width, entry)]
        first = {lr: score for lr, runs in by_lr.items() for seed, score, _ in runs if seed == 0}
        best = best_lr(first) if first else min(by_lr)
        at = sorted(by_lr[best])
        others = [loss for lr, runs in by_lr.items() if lr != best for _, _, loss in runs if loss is not None]
        rest = f"{min(others):.2f}-{max(others):.2f} ({len(others)})" if others else "-"
        losses = ", ".join("-" if loss is None else f"{loss:.2f}" for _, _, loss in at)
        lines.append(f"| {length} | {width} | {entry} | {best:g} | {len(at)} | "
                     f"{', '.join(f'{score:.3f}' for _, score, _ in at)} | {losses} | {rest} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="results_tools.py recall-escape", description=__doc__.split("\n")[0])
    ap.add_argument("folder", type=Path, help="a recall grid's folder (runs/ or runs.tar.xz)")
    ap.add_argument("--archive", type=Path, help="read this archive of runs (PREFIX/RUN/FILE members) instead")
    ap.add_argument("--per-run", action="store_true",
                    help="with --archive: a line for every run, those cut before their end too")
    ap.add_argument("--by-entry", action="store_true",
                    help="a line per length, width and entry: the best rate's seeds and the last losses")
    ap.add_argument("--length", type=int, help="with --by-entry: this sequence length only")
    ap.add_argument("--out", type=Path, help="also write the table to this markdown file")
    a = ap.parse_args(argv)
    if a.length is not None and not a.by_entry:
        ap.error(f"--length {a.length} goes with --by-entry")
    return guarded(ap, lambda: by_entry(ap, a) if a.by_entry else by_cell(ap, a))


def by_cell(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """The table a cell a line (or, with ``--per-run``, a run a line of an archive), printed and
    written to ``--out``."""
    if a.archive is not None and not a.archive.is_file():
        ap.error(f"--archive {a.archive}: no such file")
    if a.per_run and a.archive is None:
        ap.error("--per-run reads an archive: give --archive FILE.tar.xz")
    if a.per_run:
        runs = archive_runs(a.archive)
        if not runs:
            ap.error(f"{a.archive}: no runs")
        text = per_run_table(runs)
    else:
        rows = archive_rows(a.archive) if a.archive else folder_rows(a.folder)
        if not rows:
            ap.error(f"{a.archive or a.folder}: no finished runs")
        text = table(rows)
    return emit(text, a.out)


def by_entry(ap: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    """``--by-entry``: :func:`entry_table` of the grid's folder, printed and written to ``--out``."""
    if a.archive is not None or a.per_run:
        ap.error("--by-entry reads the grid's folder: leave out --archive and --per-run")
    groups = entry_groups(a.folder, a.length)
    if not groups:
        ap.error(f"{a.folder}: no finished runs" + (f" of length {a.length}" if a.length is not None else ""))
    text = entry_table(groups)
    return emit(text, a.out)
