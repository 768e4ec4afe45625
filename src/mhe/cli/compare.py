"""Comparison commands: ``mhe compare`` (the main job: every attention kind trained the same
way), ``mhe report`` and ``mhe overview`` (tables and plots from finished comparisons)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from mhe.attention import parse_kinds
from mhe.cli.common import DATA_DIR_HELP, refuse_set_keys
from mhe.data.corpora import corpus_names
from mhe.data.benchmarks import BENCH_TASKS as BENCH
from mhe.errors import MheError, one_of
from mhe.experiments.entries import parse_entries
from mhe.experiments.paper import paper_table
from mhe.models import PRESETS
from mhe.output_paths import check_output_dir, check_output_file, image_suffixes


def compare_args(p):
    p.add_argument("--task", default=None, help="recall, lm, mlm, or a fine-tuning task with --pretrained "
                                                "(default: the preset's)")
    p.add_argument("--preset", default=None,
                   help="a comparison preset (cpu-recall, cpu-ptb, gpu-ptb, paper-table2, ...) or a model preset")
    p.add_argument("--kinds", default=None,
                   help="comma-separated attention kinds (default: the preset's); an MHE kind may name its rotary "
                        "order, e.g. 'mhe-mul psi-then-rope'")
    p.add_argument("--seeds", type=int, default=None, help="seeds per kind (default: the preset's)")
    p.add_argument("--data", default=None, help=f"corpus for lm/mlm: {corpus_names()}")
    p.add_argument("--data-dir", default="", help=DATA_DIR_HELP)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting of every run (repeatable), e.g. train.steps=200")
    p.add_argument("--workers", type=int, default=None,
                   help="runs at a time (default: one per GPU, else 2 on CPU)")
    p.add_argument("--paper", default=None, help="paper table to set beside ours (e.g. table2-ptb)")
    p.add_argument("--pretrained", default="", help="fine-tuning tasks: a comparison folder of pre-training runs")
    p.add_argument("--out", default=None, help="output folder (default runs/compare-PRESET[-TASK][-DATA])")
    p.add_argument("--resume", action="store_true",
                   help="continue the unfinished runs of the comparison in --out from their checkpoints "
                        "(finished runs are never trained again)")
    p.add_argument("--finish-by", type=float, default=None, metavar="SECONDS",
                   help="grid presets: start only runs expected to end within SECONDS of this command's start "
                        "(a run's expected time: the median of the folder's finished runs of its sequence length "
                        "and width, or for a cell with none the slowest cell of its length or, scaled, of a "
                        "shorter one); the rest wait for the next call (--resume), and the command exits 3")


# section 4.4: "For each task, we use five different seeds and report the average"
PAPER_FINETUNE_SEEDS = 5


def _is_finetuning(task: str) -> bool:
    return task in BENCH


def build_sweep(args):
    from mhe.experiments.presets import DEFAULT, EXPERIMENTS, experiment
    from mhe.experiments.sweep import Sweep, finetune_paper_table
    from mhe.tasks import TASKS

    name = args.preset or DEFAULT
    if name in EXPERIMENTS:
        exp = experiment(name)
        sweep = Sweep(exp.task, exp.preset, list(exp.kinds), exp.seeds, exp.data, args.data_dir, [], exp.paper,
                      metric=exp.metric, experiment=name, also=tuple(exp.also), kv_cache=exp.kv_cache,
                      paired=exp.paired)
    elif name in PRESETS:
        sweep = Sweep(args.task or "recall", name, list(experiment(DEFAULT).kinds), 1, args.data or "",
                      args.data_dir, [])
    else:
        from mhe.experiments.grid_presets import GRIDS
        raise one_of("preset", name, list(EXPERIMENTS) + list(GRIDS) + list(PRESETS))
    if args.task and args.task != sweep.task:
        valid = [t for t in TASKS if t != "finetune"] + list(BENCH)
        if args.task not in valid:
            raise one_of("task", args.task, valid)
        sweep.task = args.task
        sweep.experiment = ""  # an experiment's settings belong to its own task
    if args.pretrained:
        sweep.pretrained = str(args.pretrained)
    if args.kinds is not None:
        sweep.kinds = list(parse_kinds(args.kinds) if args.kinds in ("paper", "all") else parse_entries(args.kinds))
    if args.seeds is not None:
        if args.seeds <= 0:
            raise MheError(f"--seeds must be positive, got {args.seeds}")
        sweep.seeds = args.seeds
    elif name.startswith("paper-") and _is_finetuning(sweep.task):
        sweep.seeds = PAPER_FINETUNE_SEEDS
    if args.data:
        sweep.data = args.data
    if name in EXPERIMENTS and _is_finetuning(sweep.task) and not _is_finetuning(experiment(name).task):
        sweep.overrides = []  # the preset's overrides configure its pre-training, not the fine-tuning
    refuse_set_keys(args.set, {"train.seed": "--seeds (each run's seed is its number, 0 to seeds-1)",
                               "model.attention": "--kinds (one run per kind)"})
    sweep.overrides = list(sweep.overrides or []) + list(args.set)
    if args.paper is not None:
        if args.paper:
            paper_table(args.paper)
        sweep.paper = args.paper
    elif not sweep.paper and _is_finetuning(sweep.task):
        sweep.paper = finetune_paper_table(sweep)  # the paper's column for the pre-trained architecture
    return name, sweep


def cmd_grid(args) -> int:
    """``mhe compare --preset GRID``: a grid study (:mod:`mhe.experiments.grid`) in pooled workers."""
    import dataclasses

    import torch

    from mhe.experiments.grid import run_grid
    from mhe.experiments.grid_presets import GRIDS
    from mhe.output_paths import default_run_dir

    for flag, value in (("--task", args.task), ("--kinds", args.kinds), ("--data", args.data),
                        ("--paper", args.paper), ("--pretrained", args.pretrained or None)):
        if value is not None:
            raise MheError(f"{flag} does not go with the grid preset {args.preset!r} (its kinds, cells and task are "
                           "its own); give --seeds, --set, --workers, --out, --resume or --finish-by")
    grid = GRIDS[args.preset]
    if args.seeds is not None:
        if args.seeds <= 0:
            raise MheError(f"--seeds must be positive, got {args.seeds}")
        grid = dataclasses.replace(grid, seeds=args.seeds)
    refuse_set_keys(args.set, {"train.seed": "--seeds (each run's seed is its number, 0 to seeds-1)",
                               "model.attention": "the grid's kinds", "train.lr": "the grid's learning rates"})
    if args.workers is not None and args.workers <= 0:
        raise MheError(f"--workers must be a positive integer, got {args.workers}")
    if args.finish_by is not None and not 0 < args.finish_by < math.inf:
        raise MheError(f"--finish-by must be a positive, finite number of seconds, got {args.finish_by:g}")
    out = check_output_dir(args.out or default_run_dir("compare", args.preset))
    workers = args.workers or (GRID_WORKERS_PER_GPU * torch.cuda.device_count() or 2)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        summary = run_grid(args.preset, grid, out, workers=workers, resume=args.resume, overrides=list(args.set),
                           data_dir=args.data_dir, log=log, finish_by=args.finish_by)
    except KeyboardInterrupt as e:
        log(f"interrupted; continue with the same command and --resume ({out})")
        return getattr(e, "exit_code", 130)
    print(summary["markdown"])
    print(f"tables: {out}/summary.md, summary.csv, summary.json; plots: {out}/recall_vs_width.png, "
          f"{out}/recall_vs_kv_cache.png")
    return 0 if summary.get("complete", True) else GRID_LEFT_FOR_NEXT_CALL


GRID_WORKERS_PER_GPU = 8
GRID_LEFT_FOR_NEXT_CALL = 3
"""``mhe compare --finish-by``'s exit status when runs were left for the next call (a loop that
calls until it succeeds goes on)."""
"""A grid's default workers per GPU: its runs are tiny and launch-bound, so several share a card."""


def cmd_compare(args) -> int:
    import torch

    from mhe.experiments.grid_presets import GRIDS
    from mhe.experiments.sweep import default_compare_dir, run_sweep

    if args.preset in GRIDS:
        return cmd_grid(args)
    if args.finish_by is not None:
        named = repr(args.preset) if args.preset else "the default preset"
        raise MheError(f"--finish-by goes with a grid preset ({', '.join(GRIDS)}), not {named}")
    name, sweep = build_sweep(args)
    out = check_output_dir(args.out or default_compare_dir(name, sweep))
    if args.workers is not None and args.workers <= 0:
        raise MheError(f"--workers must be a positive integer, got {args.workers}")
    workers = args.workers or (torch.cuda.device_count() or 2)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        summary = run_sweep(sweep, out, workers=workers, resume=args.resume, log=log, progress=sys.stderr.isatty())
    except KeyboardInterrupt as e:
        log(f"interrupted; continue with the same command and --resume ({out})")
        return getattr(e, "exit_code", 130)  # 143 when SIGTERM stopped a run
    print(summary["markdown"])
    print(f"tables: {out}/summary.md, summary.csv, summary.json; plots: {out}/score_vs_params.png, "
          f"{out}/training_curves.png")
    return 0


def report_args(p):
    p.add_argument("dirs", nargs="+",
                   help="comparison folders (each with runs/*/results.json, or those packed in runs.tar.xz)")
    p.add_argument("--paper", default=None, help="paper table to set beside ours (default: the sweep's)")
    p.add_argument("--metric", default=None,
                   help="summarise this number of each results.json instead of the score (e.g. accuracy)")
    way = p.add_mutually_exclusive_group()
    way.add_argument("--pack", action="store_true",
                     help="instead: pack each folder's runs/ into runs.tar.xz (deterministic; report reads it "
                          "as it is), or a folder without runs/ into FOLDER.tar.xz")
    way.add_argument("--unpack", action="store_true",
                     help="instead: restore each folder's runs/ from runs.tar.xz (or FOLDER from FOLDER.tar.xz), "
                          "to resume a packed comparison")


def cmd_pack(args) -> int:
    """``mhe report --pack`` / ``--unpack``: each folder's run files into one archive and back."""
    from mhe.experiments.run_archive import pack, pack_target, unpack, unpack_target

    for d in args.dirs:
        if args.pack:
            target = pack(pack_target(d))
            print(f"packed {d} into {target} ({target.stat().st_size:,} bytes)")
        else:
            print(f"unpacked {unpack(unpack_target(d))}")
    return 0


def cmd_report(args) -> int:
    from mhe.experiments.summary import write_summary

    if args.pack or args.unpack:
        if args.paper is not None or args.metric is not None:
            raise MheError("--paper and --metric go with a report, not with --pack or --unpack")
        return cmd_pack(args)
    from mhe.experiments.grid_report import write_grid_summary

    for d in args.dirs:
        d = Path(d)
        if (d / "grid.json").is_file():  # a grid study: its own tables and figures
            if args.paper is not None or args.metric is not None:
                raise MheError(f"{d} is a grid study (grid.json); its report takes no --paper or --metric")
            print(f"## {d}\n")
            print(write_grid_summary(d)["markdown"])
            continue
        paper, metric, also, kv, paired = args.paper, args.metric, (), False, False
        if (d / "sweep.json").exists():
            recorded = json.loads((d / "sweep.json").read_text())
            paper = recorded.get("paper", "") if paper is None else paper
            metric = metric or recorded.get("metric") or None
            also, kv = tuple(recorded.get("also") or ()), bool(recorded.get("kv_cache"))
            paired = bool(recorded.get("paired"))
        summary = write_summary(d, paper_table=paper or "", metric=metric, strict_paper=True, also=also,
                                kv_cache=kv, paired=paired)
        print(f"## {d}\n")
        print(summary["markdown"])
    return 0


def overview_args(p):
    p.add_argument("dirs", nargs="+", help="comparison folders with summary.json (e.g. results/encoder-*)")
    p.add_argument("--out", default=None, help="also write the table to this Markdown file")
    p.add_argument("--plot", default=None, help="also draw the averages' PRR beside the paper's (PNG)")


def cmd_overview(args) -> int:
    from mhe.experiments.summary import overview
    from mhe.training.checkpoint import write_text_atomic

    if args.out:
        check_output_file(args.out, "--out", parent_must_exist=True)
    if args.plot:
        check_output_file(args.plot, "--plot", suffixes=image_suffixes(), parent_must_exist=True)
    md = overview([Path(d) for d in args.dirs], plot=Path(args.plot) if args.plot else None)
    print(md)
    if args.out:
        write_text_atomic(Path(args.out), md)
    return 0
