"""The tables and figures of a grid study (:mod:`mhe.experiments.grid`), from its run files alone
(``runs/`` or ``runs.tar.xz``): ``mhe report OUT`` rebuilds them.

* ``summary.md``: per sequence length, each row's mean ± std over seeds at its best learning rate,
  one column per width, and its KV cache per token; then the learning-rate sweep (seed 0).
* ``summary.csv`` / ``summary.json``: one record per (row, length, width) with its rate, scores
  and KV cache, and ``sweep``: every seed-0 score by rate.
* ``recall_vs_width.png``: the score against width, one panel per sequence length, one line per
  row (Zoology's figure 2); ``recall_vs_kv_cache.png``: the same against KV-cache bytes per token.

A row is a run's kind as :func:`mhe.experiments.entries.row_name` names it, with `` (rotary)``
after a kind of the rotary block that names no rotary order (its MHA beside the GPT-2 block's).
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

from mhe.experiments.entries import row_name
from mhe.experiments.grid import best_lr
from mhe.experiments.plots import _colour, _plt, label
from mhe.experiments.run_archive import RunFiles
from mhe.experiments.summary import _from_config, _order
from mhe.errors import MheError
from mhe.training.checkpoint import write_json_atomic, write_text_atomic


def grid_rows(out: Path) -> list[dict]:
    """One record per finished run: row, length, pairs, width, lr, seed, score, KV cache per token
    (bf16) and attention parameters, from its ``config.json`` and ``results.json``."""
    files = RunFiles(out)
    runs = []
    for name in files.finished():
        res, rec = files.results(name), files.config(name)
        if rec is None:
            raise MheError(f"{files.where(name, 'config.json')}: missing; the grid reads each run's settings there")
        run, model = rec["run"], rec["model"]
        opts = run["data"]["task_options"]
        row = row_name(model)
        if model.get("positions") == "rotary" and " " not in row:
            row += " (rotary)"
        runs.append({"run": name, "row": row, "length": opts.get("seq_len") or 2 * (opts["pairs"] + opts["queries"]),
                     "pairs": opts["pairs"], "width": model["d_model"], "lr": run["train"]["lr"],
                     "seed": run["train"]["seed"], "score": res["score"], "attention_params": res["attention_params"],
                     "kv_cache_bytes_per_token": _from_config(rec, True).get("kv_cache_bytes_per_token")})
    if not runs:
        raise MheError(f"{out}: no finished runs to summarise")
    return runs


def aggregate_grid(runs: list[dict]) -> dict:
    """Per (row, length, width): the best rate of seed 0 and the mean ± std of the seeds there."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["row"], r["length"], r["width"]), []).append(r)
    cells, sweep = [], []
    for (row, length, width), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], _order(kv[0][0]), kv[0][2])):
        by_lr = {r["lr"]: r["score"] for r in rs if r["seed"] == 0}
        sweep.append({"row": row, "length": length, "width": width, "scores": dict(sorted(by_lr.items()))})
        lr = best_lr(by_lr) if by_lr else min(r["lr"] for r in rs)
        scores = [r["score"] for r in sorted((r for r in rs if r["lr"] == lr), key=lambda r: r["seed"])]
        first = rs[0]
        cells.append({"row": row, "length": length, "pairs": first["pairs"], "width": width, "lr": lr,
                      "mean": statistics.fmean(scores), "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                      "n_seeds": len(scores), "scores": scores, "attention_params": first["attention_params"],
                      "kv_cache_bytes_per_token": first["kv_cache_bytes_per_token"]})
    return {"cells": cells, "sweep": sweep}


def _sorted_rows(cells):
    return sorted({c["row"] for c in cells}, key=_order)


def markdown(summary: dict) -> str:
    """The tables of :func:`aggregate_grid`'s result."""
    cells, lines = summary["cells"], []
    widths = sorted({c["width"] for c in cells})
    for length in sorted({c["length"] for c in cells}):
        at = {(c["row"], c["width"]): c for c in cells if c["length"] == length}
        pairs = next(c["pairs"] for c in cells if c["length"] == length)
        lines += [f"### Sequence length {length}, {pairs} key-value pairs: accuracy (mean ± std over seeds, "
                  "best learning rate)", "",
                  "| Attention | " + " | ".join(f"d={w}" for w in widths) + " | KV cache / token at d=" +
                  f"{widths[-1]} (bf16) |", "|---|" + "---:|" * (len(widths) + 1)]
        for row in _sorted_rows(at.values()):
            cell = [at.get((row, w)) for w in widths]
            text = ["-" if c is None else (f"{c['mean']:.3f} ± {c['std']:.3f}" if c["n_seeds"] > 1 else f"{c['mean']:.3f}")
                    + ("" if c is None else f" ({c['n_seeds']})") for c in cell]
            kv = cell[-1]["kv_cache_bytes_per_token"] if cell[-1] else None
            lines.append(f"| {label(row)} | " + " | ".join(text) + f" | {'-' if kv is None else f'{kv:,} B'} |")
        lines.append("")
    lines += ["### Learning-rate sweep (seed 0): accuracy at each rate, the chosen one in bold", "",
              "| length | width | Attention | " + " | ".join(f"lr {lr:g}" for lr in _rates(summary)) + " |",
              "|---:|---:|---|" + "---:|" * len(_rates(summary))]
    for s in summary["sweep"]:
        best = best_lr(s["scores"]) if s["scores"] else None
        text = ["-" if lr not in s["scores"] else (f"**{s['scores'][lr]:.3f}**" if lr == best else f"{s['scores'][lr]:.3f}")
                for lr in _rates(summary)]
        lines.append(f"| {s['length']} | {s['width']} | {label(s['row'])} | " + " | ".join(text) + " |")
    lines += ["", "Accuracy over the queried values of the test sequences (1.0: every value recalled); "
              "(n): seeds at the best rate. KV cache: bytes per token of one sequence in bf16 "
              "(2 x layers x cached K/V heads x head dimension x 2)."]
    return "\n".join(lines) + "\n"


def _rates(summary):
    return sorted({lr for s in summary["sweep"] for lr in s["scores"]})


def plot_grid(summary: dict, path: Path, *, x: str) -> list[str]:
    """One panel per sequence length, one line per row: the score against ``x`` (``width`` or
    ``kv_cache_bytes_per_token``), each point the mean over seeds with its spread. One legend
    beside the panels names every row of every panel (a row may be missing from some lengths);
    returns its labels."""
    plt = _plt()
    cells = summary["cells"]
    lengths = sorted({c["length"] for c in cells})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4.2 * len(lengths), 4), sharey=True, squeeze=False)
    for ax, length in zip(axes[0], lengths):
        for row in _sorted_rows(c for c in cells if c["length"] == length):
            pts = sorted((c for c in cells if c["length"] == length and c["row"] == row), key=lambda c: c[x] or 0)
            ax.errorbar([c[x] for c in pts], [c["mean"] for c in pts], yerr=[c["std"] for c in pts], capsize=2,
                        marker="s" if row.endswith("psi-then-rope") else "o", ms=4, color=_colour(row),
                        linestyle="--" if "rotary" in row or "rope" in row else "-", label=label(row))
        pairs = next(c["pairs"] for c in cells if c["length"] == length)
        ax.set_title(f"length {length}, {pairs} pairs")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("model width" if x == "width" else "KV cache per token (bytes, bf16)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("recall accuracy")
    named: dict[str, object] = {}
    for ax in axes[0]:
        for handle, name in zip(*ax.get_legend_handles_labels()):
            named.setdefault(name, handle)
    fig.legend(list(named.values()), list(named), fontsize=7, loc="center right")
    fig.tight_layout(rect=(0, 0, 1 - 1.3 / fig.get_figwidth(), 1))  # room on the right for the legend
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return list(named)


def write_grid_summary(out: str | Path) -> dict:
    """Write ``summary.md``, ``summary.csv``, ``summary.json`` and the two figures; returns the summary."""
    out = Path(out)
    grid = json.loads((out / "grid.json").read_text())
    summary = {"grid": grid["grid"], "task": grid["task"], **aggregate_grid(grid_rows(out))}
    md = markdown(summary)
    write_json_atomic(out / "summary.json", {**summary, "sweep": [{**s, "scores": {f"{k:g}": v for k, v in
                                                                                  s["scores"].items()}}
                                                                   for s in summary["sweep"]]})
    write_text_atomic(out / "summary.md", md)
    tmp = out / ".summary.csv.tmp"
    keys = ["row", "length", "pairs", "width", "lr", "mean", "std", "n_seeds", "attention_params",
            "kv_cache_bytes_per_token"]
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(keys)
        for c in summary["cells"]:
            w.writerow([c[k] for k in keys])
    tmp.replace(out / "summary.csv")
    plot_grid(summary, out / "recall_vs_width.png", x="width")
    plot_grid(summary, out / "recall_vs_kv_cache.png", x="kv_cache_bytes_per_token")
    return {**summary, "markdown": md}
