#!/usr/bin/env python
"""lm-evaluation-harness beside mhe's own scores, one seed per kind of a comparison (issue 64).

    python benchmarks/harness_table.py COMPARISON --data-dir DATA --device cuda --workers 7 --out results/llama-6x512
    python benchmarks/harness_table.py COMPARISON --seed 0 --limit 2 --device cpu --out /tmp/harness-smoke

COMPARISON is an ``mhe compare`` folder whose ``runs/KIND-seedN`` folders still hold their weights
(the committed results/ folders keep only the records, so the runs are trained again on a GPU
first, e.g. ``mhe compare --preset gpu-llama-6x512 --seeds 1``). Each ``KIND-seedSEED`` run is
scored with ``mhe eval --harness``'s code (:func:`mhe.harness.evaluate.run_harness`: exported to a
temporary folder, the harness's ``hf`` model, the shipped offline tasks; its own
``harness-results.json`` / ``.md`` saved in the run folder; ``--workers N`` scores N runs at
once, each in a process of its own, as ``mhe compare`` trains several runs on one card), and one
row per kind sets the
harness's word perplexities and zero-shot accuracies beside the run's ``results.json``
(mhe's sliding-window perplexity per token and per word of its test corpus, WikiText-2 for the
``offline-english`` comparisons, and per word on PTB). The table is
written to ``OUT/harness.md`` and ``OUT/harness.json`` (docs/harness.md says how the two protocols
differ, so the two perplexity columns of a corpus are not expected to be equal).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import toolbox  # noqa: E402,F401  (this checkout's src first)

from mhe.errors import MheError  # noqa: E402
from mhe.harness.evaluate import run_harness, save_results  # noqa: E402
from mhe.training.atomic import write_json_atomic, write_text_atomic  # noqa: E402

TASKS = ("mhe_wikitext2", "mhe_ptb", "mhe_rte", "mhe_cb", "mhe_copa", "mhe_wic")
COLUMNS = (  # (header, where: "mhe" results.json key or (task, harness metric))
    ("mhe ppl/token WT2", "perplexity"),
    ("mhe ppl/word WT2", "word_perplexity"),
    ("harness ppl/word WT2", ("mhe_wikitext2", "word_perplexity,none")),
    ("harness bits/byte WT2", ("mhe_wikitext2", "bits_per_byte,none")),
    ("mhe ppl/word PTB", "ptb_word_perplexity"),
    ("harness ppl/word PTB", ("mhe_ptb", "word_perplexity,none")),
    ("RTE acc", ("mhe_rte", "acc,none")),
    ("CB acc", ("mhe_cb", "acc,none")),
    ("COPA acc", ("mhe_copa", "acc,none")),
    ("WiC acc", ("mhe_wic", "acc,none")),
)


def score_run(run: Path, args) -> dict:
    """One row: the run's own scores and the harness's, or why the run was left out."""
    suffix = f"-seed{args.seed}"
    row = {"kind": run.name[:-len(suffix)], "run": run.name}
    if not (run / "results.json").is_file():  # stopped before its final evaluation: nothing to set beside
        return {**row, "skipped": "not finished (no results.json)"}
    own = json.loads((run / "results.json").read_text())
    try:
        results = run_harness(run, list(args.tasks.split(",")), data_dir=args.data_dir, limit=args.limit,
                              device=args.device, batch_size=args.batch_size, max_length=args.max_length)
    except MheError as e:
        return {**row, "skipped": str(e)}
    save_results(results, run)
    for header, where in COLUMNS:
        if isinstance(where, str):
            row[header] = own.get(where)
        else:
            row[header] = results["results"].get(where[0], {}).get(where[1])
    return row


def score_runs(runs: list[Path], args) -> list[dict]:
    """The rows of ``runs`` in their order: in this process, or ``args.workers`` spawned
    processes at a time (a fresh CUDA context each; the harness's bars interleave on stderr)."""
    if args.workers <= 1 or len(runs) <= 1:
        return [score_run(run, args) for run in runs]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=min(args.workers, len(runs)), mp_context=spawn) as pool:
        return list(pool.map(score_run, runs, [args] * len(runs)))


def table(rows: list[dict], args) -> str:
    """The markdown table, then what was left out and how it was made."""
    lines = ["| Attention | " + " | ".join(h for h, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for r in rows:
        if "skipped" in r:
            continue
        cells = ["-" if r[h] is None else f"{r[h]:.4g}" for h, _ in COLUMNS]
        lines.append(f"| {r['kind']} | " + " | ".join(cells) + " |")
    lines += ["", f"Seed {args.seed} of each kind; harness: lm-eval's `hf` model on the run exported with its own "
                  f"modeling code, the shipped offline tasks ({args.tasks}), zero-shot, "
                  + (f"{args.limit} documents per task" if args.limit else "every document")
                  + (f", windows of {args.max_length} tokens" if args.max_length else ", the model's window")
                  + "; mhe: the run's results.json (sliding window, its stride). docs/harness.md: how the "
                    "two protocols differ."]
    lines += [f"- left out: {r['run']}: {r['skipped']}" for r in rows if "skipped" in r]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("comparison", type=Path, help="an mhe compare folder whose runs/ hold their weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tasks", default=",".join(TASKS))
    p.add_argument("--data-dir", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--limit", type=int, default=None, help="documents per task (default all)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-length", type=int, default=None, help="the harness's window (default the model's)")
    p.add_argument("--workers", type=int, default=1, help="runs scored at once, one process each (default 1)")
    p.add_argument("--out", type=Path, required=True, help="the folder harness.md and harness.json go to")
    args = p.parse_args(argv)
    for name in ("workers", "max_length", "limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive whole number, got {getattr(args, name)}")
    runs = sorted((args.comparison / "runs").glob(f"*-seed{args.seed}"))
    if not runs:
        raise SystemExit(f"no runs/*-seed{args.seed} under {args.comparison}")
    rows = score_runs(runs, args)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.out / "harness.json", {"seed": args.seed, "tasks": args.tasks, "limit": args.limit,
                                                  "max_length": args.max_length, "rows": rows})
    write_text_atomic(args.out / "harness.md", table(rows, args))
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
