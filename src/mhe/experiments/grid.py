"""A study over a grid: every entry (attention kind, in one or more model blocks) at every cell
(a sequence length and its number of key-value pairs) and width, each at its best learning rate
from a sweep, then more seeds at that rate; Zoology's recall figure is such a grid (Arora et al.
2023, figure 2). ``mhe compare --preset gpu-recall-zoology`` runs one (:mod:`mhe.experiments.grid_presets`).

Two phases, in one command: seed 0 of every entry, cell and width at each learning rate, then,
as soon as a group's sweep is finished, seeds 1.. at its best rate (ahead of the sweeps still
waiting, so groups finish whole) (the highest score; of equal
scores the smallest rate). With ``Grid.extend``, a sweep whose best rate lies at an edge, strictly
above its neighbour, first adds the next rate past that edge on the 1-3 ladder (1e-2 -> 3e-2,
1e-3 -> 3e-4), up to ``extend`` rates, so that the chosen rate is bracketed where it can be. Runs go to ``OUT/runs/L{length}-d{width}-{block-}{entry}-lr{rate}-seed{s}``,
are trained by a pool of long-lived workers (:mod:`mhe.experiments.pool`: hundreds of tiny runs,
one process start per worker, not per run), and follow the rerun rule: finished runs are read, not
trained again; unfinished ones continue with ``--resume``, length by length, each length's leftover
seeds first. With ``finish_by`` (``mhe compare --finish-by``) a call starts only runs that its
cells' finished runs say can end by then; the rest wait for the next call. ``OUT/grid.json`` records what was asked;
the tables and figures (:mod:`mhe.experiments.grid_report`) are rebuilt by ``mhe report OUT``.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Callable

from mhe.errors import MheError
from mhe.experiments.entries import entry_dir, parse_entry
from mhe.experiments.run_archive import RunFiles, archive_of
from mhe.output_paths import free_name
from mhe.tasks import default_run, read_run_config
from mhe.training.checkpoint import write_json_atomic
from mhe.training.config import RunConfig, apply_overrides, validate
from mhe.training.run_files import CONFIG, RESULTS, differences, is_run_dir, read_run_record


@dataclass(frozen=True)
class Block:
    """A model family of the grid: its model preset and entries; ``name`` prefixes its runs
    ("" for the first block)."""

    name: str
    preset: str
    entries: tuple[str, ...]


@dataclass(frozen=True)
class Grid:
    task: str
    blocks: tuple[Block, ...]
    cells: tuple[tuple[int, int], ...]   # (sequence length, key-value pairs)
    widths: tuple[int, ...]
    lrs: tuple[float, ...]
    seeds: int
    configure: Callable[[RunConfig, int, int, int], RunConfig]  # (cfg, length, pairs, width) -> cfg
    note: str = ""
    extend: int = 0  # rates a sweep may add past the edge its best lies on (one at a time)

    def points(self):
        """(block, entry, length, pairs, width) of every group: the shortest sequences first (a
        call stopped by a deadline leaves whole lengths done), within one the widest models first
        (they take longest: started first, the workers end together). A call queues each length's
        leftover seeds before its sweeps (:meth:`GridRun.todo`), and with a deadline it skips runs
        that could not end by it (:func:`may_start`)."""
        return [(b, e, length, pairs, w) for length, pairs in sorted(self.cells)
                for w in sorted(self.widths, reverse=True) for b in self.blocks for e in b.entries]


@dataclass(frozen=True)
class Point:
    """One run of a grid."""

    block: Block
    entry: str
    length: int
    pairs: int
    width: int
    lr: float
    seed: int

    @property
    def group(self) -> tuple:
        return (self.block.name, self.entry, self.length, self.width)

    def name(self) -> str:
        block = f"{self.block.name}-" if self.block.name else ""
        return f"L{self.length}-d{self.width}-{block}{entry_dir(self.entry)}-lr{self.lr:g}-seed{self.seed}"


def run_config(grid: Grid, p: Point, overrides: list[str] | None = None, data_dir: str = "") -> RunConfig:
    """One run's configuration: the task's defaults for the block's preset and the entry's kind,
    the grid's settings for the cell and width, the entry's rotary order, the learning rate,
    the ``--set`` items, the seed."""
    kind = parse_entry(p.entry)
    cfg = default_run(grid.task, p.block.preset, kind.spec.name)
    cfg = kind.apply(grid.configure(cfg, p.length, p.pairs, p.width))
    cfg.train.lr = p.lr
    cfg.data.data_dir = data_dir
    cfg = apply_overrides(cfg, list(overrides or []))
    cfg.train.seed = p.seed
    validate(cfg)
    return cfg


def kv_heads(cfg: RunConfig, n: int) -> RunConfig:
    """``cfg`` with ``n`` grouped K/V heads where its kind has that option (GQA)."""
    opts = cfg.model.attn_options
    if any(f.name == "n_kv_heads" for f in fields(opts)):
        cfg.model = cfg.model.replace(attn_options=replace(opts, n_kv_heads=n))
    return cfg


def ladder(lr: float, step: int) -> float:
    """The rate ``step`` half-decades from ``lr`` on the 1-3 ladder (..., 1e-3, 3e-3, 1e-2, 3e-2, ...)."""
    k = round(2 * math.log10(lr)) + step
    return float(f"{1 if k % 2 == 0 else 3}e{k // 2}")


def edge_step(scores: dict[float, float]) -> int:
    """-1 or +1 where the best of ``scores`` (by :func:`best_lr`) is the lowest or highest rate and
    strictly above the next one (a neighbour with no score, NaN: a diverged run, counts as below);
    0 where the best is inside or ties its neighbour (a flat top)."""
    lrs = sorted(scores)
    best = best_lr(scores)
    if len(lrs) < 2 or best not in (lrs[0], lrs[-1]):
        return 0
    near = lrs[1] if best == lrs[0] else lrs[-2]
    s, n = scores[best], scores[near]
    if n is None or math.isnan(n):
        return -1 if best == lrs[0] else 1
    return (-1 if best == lrs[0] else 1) if s > n else 0


def best_lr(scores: dict[float, float], higher_is_better: bool = True) -> float:
    """The rate of the best score; of equal scores the smallest rate; NaN scores lose."""
    def key(lr):
        s = scores[lr]
        bad = s is None or math.isnan(s)
        return (bad, -s if (higher_is_better and not bad) else (s if not bad else 0.0), lr)
    return min(scores, key=key)


class GridRun:
    """The runs of one grid in one folder: which are finished, which to do next."""

    def __init__(self, grid: Grid, out: Path, overrides: list[str] | None = None, data_dir: str = ""):
        self.grid, self.out, self.overrides, self.data_dir = grid, Path(out), list(overrides or []), data_dir
        self.handed: set[str] = set()  # runs next_after gave out (two runs ending together see one group)

    def path(self, p: Point) -> Path:
        return self.out / "runs" / p.name()

    def finished(self, p: Point) -> bool:
        return (self.path(p) / RESULTS).is_file()

    def score(self, p: Point) -> float | None:
        f = self.path(p) / RESULTS
        return json.loads(f.read_text())["score"] if f.is_file() else None

    def sweep(self, block, entry, length, pairs, width) -> list[Point]:
        """Seed 0 at the grid's rates and at each rate the sweep added past an edge so far
        (``Grid.extend``: one more while the finished sweep's best lies at an edge)."""
        lrs = sorted(self.grid.lrs)
        points = lambda: [Point(block, entry, length, pairs, width, lr, 0) for lr in lrs]  # noqa: E731
        for _ in range(self.grid.extend):
            done = points()
            if not all(self.finished(p) for p in done):
                break
            step = edge_step({p.lr: self.score(p) for p in done})
            if step == 0:
                break
            lrs = sorted(lrs + [ladder(lrs[0] if step < 0 else lrs[-1], step)])
        return points()

    def seeds_of(self, block, entry, length, pairs, width) -> list[Point]:
        """Seeds 1.. at the group's best rate, once its sweep is finished ([] before)."""
        sweep = self.sweep(block, entry, length, pairs, width)
        if not all(self.finished(p) for p in sweep):
            return []
        best = best_lr({p.lr: self.score(p) for p in sweep})
        return [Point(block, entry, length, pairs, width, best, s) for s in range(1, self.grid.seeds)]

    def todo(self) -> list[Point]:
        """Unfinished runs whose inputs are there, length by length, so that a call stopped by a
        deadline leaves whole lengths done: within a length the seeds of finished sweeps first
        (they finish their groups, as the queue puts a finished run's follow-ups first), then the
        sweep runs. (Every length's sweeps once came first, and a seed run stopped at a deadline
        then waited behind the sweeps of all the longer lengths.)"""
        out = []
        for length in sorted({cell[0] for cell in self.grid.cells}):
            groups = [pt for pt in self.grid.points() if pt[2] == length]
            out += [p for pt in groups for p in self.seeds_of(*pt) if not self.finished(p)]
            out += [p for pt in groups for p in self.sweep(*pt) if not self.finished(p)]
        return out

    def stale(self) -> list[tuple[Point, str]]:
        """Finished runs trained with other settings than the grid builds for them now (the preset
        changed since, e.g. a length's steps), each with what differs. A run's saved configuration
        (``config.json``) is read back and hashed by today's code, as the trainer does before it
        resumes (the task compared first), so a setting added since (its default in both) does not
        count; a finished run without a readable one is listed too. Read as finished such runs
        would put two settings in one cell."""
        found = []
        for group in self.grid.points():
            for p in self.sweep(*group) + self.seeds_of(*group):
                if self.finished(p) and (why := self._differs(p)):
                    found.append((p, why))
        return found

    def _differs(self, p: Point) -> str:
        """What differs between finished run ``p``'s saved configuration and the grid's ("" if nothing)."""
        if not (self.path(p) / CONFIG).is_file():
            return f"no {CONFIG}"
        now = run_config(self.grid, p, self.overrides, self.data_dir)
        try:
            task = read_run_record(self.path(p))["run"].get("task")
            if task != now.task:
                return f"task: {task!r} there, {now.task!r} now"
            saved = read_run_config(self.path(p))
        except MheError as e:
            return f"its {CONFIG} cannot be read ({e})"
        return differences(saved.identity(), now.identity()) if saved.hash() != now.hash() else ""

    def next_after(self, p: Point) -> list[Point]:
        """What a finished run makes possible: the rate its group's sweep adds past an edge, or the
        group's seeds once the sweep is complete; each run handed out once."""
        if p.seed != 0:
            return []
        group = (p.block, p.entry, p.length, p.pairs, p.width)
        added = [q for q in self.sweep(*group) if q.lr not in self.grid.lrs]
        new = [q for q in added + self.seeds_of(*group) if not self.finished(q) and q.name() not in self.handed]
        self.handed.update(q.name() for q in new)
        return new


def grid_record(name: str, grid: Grid, overrides: list[str]) -> dict:
    """What ``grid.json`` keeps: the preset and its axes, the --set items (``mhe report`` reads it)."""
    return {"grid": name, "task": grid.task, "cells": [list(c) for c in grid.cells], "widths": list(grid.widths),
            "lrs": list(grid.lrs), "extend": grid.extend, "seeds": grid.seeds, "overrides": list(overrides),
            "blocks": [{"name": b.name, "preset": b.preset, "entries": list(b.entries)} for b in grid.blocks],
            "note": grid.note}


def check_grid_dir(out: Path, record: dict) -> None:
    """Refuse a folder holding another grid (another preset or other --set items); more seeds,
    cells, widths, rates or entries extend one."""
    f = out / "grid.json"
    if f.is_file():
        old = json.loads(f.read_text())
        diffs = [f"{k}: {old.get(k)!r} there, {record[k]!r} now" for k in ("grid", "task", "overrides")
                 if old.get(k) != record[k]]
        if diffs:
            raise MheError(f"{out} holds another grid ({'; '.join(diffs)}); choose another --out "
                           f"({free_name(out)} is free)")


class RunDurations:
    """Seconds the finished runs of each (sequence length, width) took (their ``wall_clock``'s
    ``total_s``), read from the folder and added as runs finish: what a run of that cell is
    expected to take, so that a call with a deadline starts only runs that can end by it."""

    def __init__(self, state: GridRun):
        self.state = state
        self.seconds: dict[tuple[int, int], list[float]] = {}
        self.steps_of: dict[tuple[str, str, int, int], int] = {}
        for f in (state.out / "runs").glob(f"*/{RESULTS}"):
            self._read(f)

    def _read(self, f: Path) -> None:
        """A run's time less its process's start-up (paid once per pooled worker). A run resumed
        from a checkpoint reports its last part only, an underestimate the median mostly absorbs."""
        cell = re.match(r"L(\d+)-d(\d+)-", f.parent.name)
        try:
            clock = json.loads(f.read_text())["wall_clock"]
            took = float(clock["total_s"]) - float(clock.get("startup_s") or 0.0)
        except (KeyError, TypeError, ValueError, OSError):
            return
        if cell and math.isfinite(took) and took >= 0:
            self.seconds.setdefault((int(cell[1]), int(cell[2])), []).append(took)

    def add(self, p: Point) -> None:
        """A run that finished: its time counts from now on."""
        if self.state.finished(p):
            self._read(self.state.path(p) / RESULTS)

    def expected(self, p: Point) -> float | None:
        """The median time of the finished runs of ``p``'s length and width. For a cell with none
        yet, a guess on the long side (a run judged too long only waits for the next call; one
        started blind is cut at the deadline): the slowest cell median at its length, else that of
        the longest shorter length with finished runs, times the ratio of the lengths and of their
        steps; None when no shorter length has any."""
        seen = self.seconds.get((p.length, p.width))
        if seen:
            return statistics.median(seen)
        medians = {cell: statistics.median(times) for cell, times in self.seconds.items() if times}
        same = [m for (length, _), m in medians.items() if length == p.length]
        if same:
            return max(same)
        shorter = [length for length, _ in medians if length < p.length]
        if not shorter:
            return None
        near = max(shorter)
        slowest = max(m for (length, _), m in medians.items() if length == near)
        steps = self._steps(p, p.length) / self._steps(p, near) if near in dict(self.state.grid.cells) else 1.0
        return slowest * p.length / near * steps

    def _steps(self, p: Point, length: int) -> int:
        """The steps the grid trains ``p``'s entry and width for at ``length`` (lengths may differ in steps);
        kept, as the queue asks under its lock for every waiting run."""
        key = (p.block.name, p.entry, p.width, length)
        if key not in self.steps_of:
            q = replace(p, length=length, pairs=dict(self.state.grid.cells)[length])
            self.steps_of[key] = run_config(self.state.grid, q, self.state.overrides, self.state.data_dir).train.steps
        return self.steps_of[key]


def run_grid(name: str, grid: Grid, out: str | Path, *, workers: int, resume: bool = False,
             overrides: list[str] | None = None, data_dir: str = "", log=print,
             finish_by: float | None = None) -> dict:
    """Run what is missing of the grid in ``out`` with ``workers`` pooled workers, then write the
    tables and figures; returns the summary, with ``complete`` false where runs were left for
    the next call. With ``finish_by`` (seconds from this process's start) a run starts only if it
    is expected to end by then (:func:`may_start`, :class:`RunDurations`; a cell with no finished
    run is judged by its length's other cells or a shorter length's), so that a call cut at that
    deadline stops few runs midway."""
    from mhe.experiments.grid_report import write_grid_summary

    out = Path(out)
    overrides = list(overrides or [])
    record = grid_record(name, grid, overrides)
    check_grid_dir(out, record)
    state = GridRun(grid, out, overrides, data_dir)
    for b in grid.blocks:  # every entry's settings checked before a folder is made
        for e in b.entries:
            run_config(grid, Point(b, e, grid.cells[0][0], grid.cells[0][1], grid.widths[0], grid.lrs[0], 0),
                       overrides, data_dir)
    if archive_of(out / "runs").is_file():
        RunFiles(out)  # refuses a folder holding both
        log(f"packed ({archive_of(out / 'runs').name}): reporting it as it is; unpack it to train more "
            f"(mhe report --unpack {out})")
        return write_grid_summary(out)
    if stale := state.stale():
        names = ", ".join(p.name() for p, _ in stale[:3]) + (", ..." if len(stale) > 3 else "")
        raise MheError(f"{out} holds {len(stale)} finished run(s) trained with other settings than the grid's now "
                       f"({names}; {stale[0][0].name()}: {stale[0][1]}): move them out of {out / 'runs'} "
                       "to train them again")
    todo = state.todo()
    state.handed.update(p.name() for p in todo)  # queued now: a finished run must not hand them out again
    unfinished = [p.name() for p in todo if is_run_dir(state.path(p))]
    if unfinished and not resume:
        raise MheError(f"{out} holds {len(unfinished)} unfinished run(s) of this grid ({', '.join(unfinished[:3])}"
                       f"{', ...' if len(unfinished) > 3 else ''}); pass --resume to continue them")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "grid.json", record)
    if todo:
        log(f"grid {name}: {len(todo)} run(s) to do now (more seeds follow each finished sweep), "
            f"{workers} worker(s) -> {out}")
        complete = train_pooled(state, todo, workers, log, finish_by)
    else:
        log(f"already finished: results in {out}")
        complete = True
    return {**write_grid_summary(out), "complete": complete}


def may_start(elapsed: float, expected: float | None, finish_by: float | None) -> bool:
    """Whether a run expected to take ``expected`` seconds (None: not known) starts ``elapsed``
    seconds into a call that should end by ``finish_by``: if it is expected to end in time, or
    nothing is known of its cell; a run longer than the whole budget, which can only end by being
    resumed, starts in the budget's first tenth only (else it would wait for ever)."""
    if finish_by is None or expected is None or elapsed + expected <= finish_by:
        return True
    return expected > finish_by and elapsed <= 0.1 * finish_by


def train_pooled(state: GridRun, todo: list[Point], workers: int, log, finish_by: float | None) -> bool:
    """Train ``todo`` (and the runs their results make possible) in a pool of ``workers``; with
    ``finish_by`` (seconds from this process's start), start only runs that :func:`may_start`.
    Returns whether every run was handed out (False: some wait for the next call)."""
    import torch

    from mhe.experiments.grid_report import write_grid_summary
    from mhe.experiments.pool import Pool, PoolJob, Queue
    from mhe.training.run_report import process_age

    grid, out, start = state.grid, state.out, time.monotonic() - process_age()
    durations = RunDurations(state)

    def job(p: Point) -> PoolJob:
        return PoolJob(p.name(), state.path(p), run_config(grid, p, state.overrides, state.data_dir), {"point": p})

    def write_config(j: PoolJob) -> None:
        j.run_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(j.run_dir / "run.json", j.config.record())

    def follow(j: PoolJob, rc: int) -> list[PoolJob]:
        durations.add(j.data["point"])
        return [job(q) for q in state.next_after(j.data["point"])]

    def admit(j: PoolJob) -> bool:
        return may_start(time.monotonic() - start, durations.expected(j.data["point"]), finish_by)

    queue = Queue([job(p) for p in todo], on_done=follow, admit=admit)
    try:
        Pool(workers, gpus=torch.cuda.device_count(), log=log).run(queue, write_config)
    finally:
        if any((out / "runs").glob(f"*/{RESULTS}")):
            write_grid_summary(out)
    if queue.failed:
        raise MheError(f"{len(queue.failed)} run(s) failed ({', '.join(j.name for j in queue.failed[:3])}); "
                       "rerun the same command with --resume to retry them")
    if queue.pending and finish_by is not None:
        log(f"{len(queue.pending)} run(s) left for the next call: they could not end within the time left of "
            f"--finish-by {finish_by:g} s (the same command with --resume continues)")
    return not queue.pending
