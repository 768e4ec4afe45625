"""What the uptraining study (``benchmarks/uptrain.py study``) writes: the summary rows, the table
(``summary.md``/``.csv``/``.json``), the plot (``uptrain.png``) and ``RUN.md``."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from toolbox import ROOT
from uptraining.jobs import Job, fraction_label


def job_results(runs: Path, job: Job) -> dict:
    """The run's ``results.json``, {} when it did not finish."""
    import json

    f = runs / job.name / "results.json"
    return json.loads(f.read_text()) if f.is_file() else {}


# the per-word numbers beside the per-token score: (row prefix, results.json key)
WORD = (("word", "word_perplexity"), ("ptb", "ptb_word_perplexity"))


def summarise(args, out: Path, study: dict) -> dict:
    """The summary rows: per kind, its cost (attention parameters, KV cache per token) and its
    test perplexity after conversion, after each uptraining (mean, std and seeds) and from scratch."""
    import statistics

    runs, conv = out / "runs", study["conversions"]
    results = {j.name: job_results(runs, j) for j in study["jobs"]}
    scores = {name: r.get("score") for name, r in results.items()}
    longest = max(round(f * args.steps) for f in args.fractions)
    rows = []
    for kind in ("mha", *args.kinds):
        c = conv.get(kind, {})
        row = {"kind": kind, "attention_params": c.get("attention_params"),
               "kv_bytes_per_token": c.get("kv_bytes_per_token"),
               "ppl_converted": c.get("ppl_source") if kind == "mha" else c.get("ppl_converted"),
               "ppl_naive": c.get("ppl_naive")}
        for f in args.fractions:
            vals = [scores[j.name] for j in study["jobs"] if j.role == "uptrain" and j.kind == kind
                    and j.fraction == f and scores.get(j.name) is not None]
            row[f"ppl_up_{fraction_label(f)}"] = statistics.fmean(vals) if vals else None
            row[f"std_up_{fraction_label(f)}"] = statistics.stdev(vals) if len(vals) > 1 else None
            row[f"seeds_up_{fraction_label(f)}"] = len(vals)
        row["ppl_scratch"] = scores.get(f"scratch-{kind}") if kind != "mha" else None
        row["scratch_steps"] = args.steps + longest if kind != "mha" else args.steps
        row.update(_word_columns(args, kind, c, study["jobs"], results))
        rows.append(row)
    return {"rows": rows, "scores": scores}


def _word_columns(args, kind: str, conv: dict, jobs: list, results: dict) -> dict:
    """Perplexity per word of WikiText-2's test split (step 0 from the conversion) and of every
    ``--also-test`` corpus (PTB), after each uptraining (mean and std) and from scratch; the
    source's own under ``mha``."""
    import statistics

    row = {"word_converted": conv.get("word_converted"), "word_naive": conv.get("word_naive")}
    own = results.get("pretrain-mha" if kind == "mha" else f"scratch-{kind}", {})
    for name, key in WORD:
        if name == "ptb":
            row["ptb_source"] = own.get(key) if kind == "mha" else None
        for f in args.fractions:
            vals = [results[j.name][key] for j in jobs if j.role == "uptrain" and j.kind == kind
                    and j.fraction == f and key in results[j.name]]
            row[f"{name}_up_{fraction_label(f)}"] = statistics.fmean(vals) if vals else None
            row[f"{name}_std_up_{fraction_label(f)}"] = statistics.stdev(vals) if len(vals) > 1 else None
        row[f"{name}_scratch"] = own.get(key) if kind != "mha" else None
    return row


def fmt(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def markdown_table(args, rows: list[dict]) -> str:
    n = args.steps
    head = ["kind", "attention params", "KV cache / token (bf16)", "converted (step 0)", "naive init (step 0)"]
    head += [f"uptrained {100 * f:g}% ({round(f * n)} steps)" for f in args.fractions]
    head += [f"from scratch ({n + max(round(f * n) for f in args.fractions)} steps)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kind"] if r["kind"] != "mha" else f"mha (source, {n} steps)",
                 fmt(r["attention_params"], 0), f"{r['kv_bytes_per_token']:,} B" if r["kv_bytes_per_token"] else "—",
                 fmt(r["ppl_converted"]), fmt(r["ppl_naive"])]
        for f in args.fractions:
            lab = fraction_label(f)
            mean, std, k = r[f"ppl_up_{lab}"], r[f"std_up_{lab}"], r[f"seeds_up_{lab}"]
            cells.append("—" if mean is None else f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else "")
                         + f" ({k} seed{'s' if k != 1 else ''})")
        cells.append(fmt(r["ppl_scratch"]))
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.get(f"ptb_up_{fraction_label(f)}") is not None for r in rows for f in args.fractions):
        lines += ["", *word_table(args, rows)]
    return "\n".join(lines) + "\n"


def _mean_std(mean, std) -> str:
    return "—" if mean is None else f"{mean:,.2f}" + (f" ± {std:,.2f}" if std is not None else "")


def word_table(args, rows: list[dict]) -> list[str]:
    """Perplexity per word: WikiText-2's test split (step 0, uptrained, from scratch) and PTB's
    (uptrained, from scratch; the source's own in the step-0 column), mean ± std over seeds."""
    n = args.steps
    ups = [(fraction_label(f), f"{100 * f:g}%") for f in args.fractions]
    head = ["kind", "WikiText-2 converted (step 0)"] + [f"WikiText-2 uptrained {t}" for _, t in ups] + [
        "WikiText-2 from scratch", "PTB source"] + [f"PTB uptrained {t}" for _, t in ups] + ["PTB from scratch"]
    lines = ["Perplexity per word (the same runs; PTB: the test split of `ptb`, scored with each run's tokenizer "
             "after training, not at step 0):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kind"] if r["kind"] != "mha" else f"mha (source, {n} steps)", fmt(r["word_converted"])]
        cells += [_mean_std(r[f"word_up_{lab}"], r[f"word_std_up_{lab}"]) for lab, _ in ups]
        cells += [fmt(r["word_scratch"]), fmt(r["ptb_source"])]
        cells += [_mean_std(r[f"ptb_up_{lab}"], r[f"ptb_std_up_{lab}"]) for lab, _ in ups]
        cells.append(fmt(r["ptb_scratch"]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_tables(args, out: Path, summary: dict) -> None:
    import csv
    import json

    (out / "summary.md").write_text(markdown_table(args, summary["rows"]))
    keys = list(summary["rows"][0])
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(summary["rows"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def plot(args, out: Path, summary: dict) -> None:
    """Test perplexity against uptraining steps per kind (mean and std over seeds; step 0 is the
    converted model), each kind's from-scratch run as a dashed line of its colour, the source
    MHA as a dotted black line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from mhe.experiments.plots import LABELS, kind_color

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in summary["rows"]:
        if r["kind"] == "mha":
            if r["ppl_converted"]:
                ax.axhline(r["ppl_converted"], color="black", ls=":", lw=1, label=f"MHA source ({args.steps} steps)")
            continue
        xs, ys, es = [0], [r["ppl_converted"]], [0.0]
        for f in args.fractions:
            lab = fraction_label(f)
            if r[f"ppl_up_{lab}"] is not None:
                xs.append(round(f * args.steps))
                ys.append(r[f"ppl_up_{lab}"])
                es.append(r[f"std_up_{lab}"] or 0.0)
        color, label = kind_color(r["kind"]), LABELS.get(r["kind"], r["kind"])
        if ys[0] is not None:
            ax.errorbar(xs, ys, yerr=es, marker="o", color=color, capsize=3, label=f"{label} uptrained")
        if r["ppl_scratch"] is not None:
            ax.axhline(r["ppl_scratch"], color=color, ls="--", lw=1, alpha=0.8)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks([0, *(round(f * args.steps) for f in args.fractions)])
    ax.set_xlabel("uptraining steps after conversion (0: the converted model)")
    ax.set_ylabel("test perplexity (WikiText-2, per token; log scale)")
    ax.set_title("Conversion from MHA, then uptraining (dashed: the kind from scratch)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "uptrain.png", dpi=120)
    plt.close(fig)


def software() -> dict:
    import platform

    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    return {"card": card, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "python": platform.python_version(), "commit": commit, "cpus": os.cpu_count()}


def write_run_md(args, out: Path, study: dict, summary: dict, sw: dict, command: str, started: str) -> None:
    """``RUN.md``: what the study is, how to run it again, this run's card, software and wall
    time, what ran, the table and every run's status."""
    lines = [f"# {out.name}: from a pre-trained MHA decoder to {', '.join(args.kinds)}", "",
             "One run of `benchmarks/uptrain.py study` from `mhe`, the implementation of multi-head embedding "
             "attention (MHE; Xue & Aletras, \"Pit One Against Many\", Findings of EMNLP 2023) and of the "
             "attention kinds it is compared with. The study asks how much of a pre-trained multi-head model's "
             "quality each cheaper kind keeps when it is converted with `mhe convert` and uptrained briefly "
             "(`mhe pretrain --init-from`, the recipe of `docs/recipes.md`), beside the same kind trained from "
             "scratch for as many steps.", "", "## Reproduce", "",
             f"On {'any machine' if args.cpu_smoke else 'a machine with a CUDA GPU'}, the repository at commit "
             f"`{sw['commit']}` installed (`pip install -e .`) and the data folder in `MHE_DATA`, from the repository "
             "root:", "", "```bash", command, "```", "",
             *_this_run(args, study, sw, started), "", "## What ran", "", *_what_ran(args), "",
             markdown_table(args, summary["rows"]), "## Runs", "", "| run | steps | status | seconds | test perplexity |",
             "|---|---:|---|---:|---:|"]
    for j in study["jobs"]:
        status = "finished" if j.rc == 0 else (f"exit {j.rc}" if isinstance(j.rc, int) else str(j.rc or "?"))
        secs = f"{j.end - j.start:.0f}" if j.end else "—"
        lines.append(f"| {j.name} | {j.steps} | {status} | {secs} | {fmt(summary['scores'].get(j.name))} |")
    lines += ["", "Files: `summary.md`, `summary.csv`, `summary.json`, `uptrain.png`; `runs/NAME/` holds each "
              "run's `config.json`, `metrics.jsonl`, `results.json` and `console.log`; `runs/convert-KIND/"
              "conversion.json` the per-sublayer reconstruction errors."]
    (out / "RUN.md").write_text("\n".join(lines) + "\n")


def _this_run(args, study: dict, sw: dict, started: str) -> list[str]:
    how = ("the trainings one after another in one process (`--inline`)" if args.inline else
           f"up to {args.workers} training processes at once on the card, so the per-run times are not comparable "
           "between runs")
    budget = (f" Runs were started only while their estimated time fitted the wall-time budget of "
              f"{args.budget_s:.0f} s (`--budget-s`), and runs still going at the budget were stopped; the table "
              "says what finished." if args.budget_s else "")
    return ["## This run", "",
            f"Card: {sw['card']}; torch {sw['torch']} (CUDA {sw['cuda']}), Python {sw['python']}, {sw['cpus']} CPU "
            f"cores. Started {started} UTC; wall time {study['wall_s'] / 60:.1f} min (tokenizer "
            f"{study['tokenizer_s']:.0f} s, conversions {study['conversions'].get('_seconds', 0):.0f} s), with "
            f"{how}; torch.compile {'on' if args.compile else 'off'}.{budget}"]


def _what_ran(args) -> list[str]:
    n, longest = args.steps, max(round(f * args.steps) for f in args.fractions)
    tokens = args.batch_size * _max_len(args)
    from mhe.models import preset

    rotary = preset(args.preset).positions == "rotary"
    test = "WikiText-2's" if args.data in ("offline-english", "wikitext-2") else f"`{args.data}`'s"
    return [
        f"An MHA decoder (preset `{args.preset}` with {', '.join(args.model_set) or 'its own sizes'}) pre-trained on "
        f"`{args.data}` for N = {n} steps of {args.batch_size} x {_max_len(args)} tokens ({n * tokens:,} tokens), "
        f"lr {args.lr:g}, cosine after a 5% warm-up; converted with `mhe convert`'s fitted initialisation "
        f"({'aligned heads' if args.align else 'no alignment'}, calibration on 32 training sequences) to "
        f"{', '.join(args.kinds)}" + (f" (GQA with {args.n_kv_heads} K/V heads)" if args.n_kv_heads else "") + "; "
        "each converted model uptrained with `mhe pretrain --init-from` (a fresh AdamW, the same peak lr, cosine "
        f"after a 5% warm-up) for {', '.join(f'{100 * f:g}% ({round(f * n)} steps)' for f in args.fractions)} of "
        f"N, seeds {'0' if args.seeds == 1 else f'0-{args.seeds - 1}'} (the table says how many finished).",
        *(["", "The decoder has rotary positions: MHE's head embeddings act after the rotation "
           "(`rope_order=rope-then-psi`, the default, one K/V head cached), so the conversion shares each head's "
           "query/key scales within the rotary pairs and fits MHE-Add's query offsets to the rotated projections "
           "(`mhe.convert.rotary`)."] if rotary else []),
        *([] if args.compile or args.inline else
          ["", "Every run trains eagerly (`train.compile=false`; `--compile` turns it on): with a dozen processes "
           "sharing the card, compiling each would take about as long as an uptraining run trains."]),
        "", f"**Same total steps.** Each kind is also trained from scratch for N + {longest} = {n + longest} "
        "optimiser steps of the same batch and schedule: as many steps and tokens as the model uptrained for the "
        f"longest fraction has seen in all ({n} as MHA, then {longest} as the kind). The compute is not the same: "
        "an MHA step costs more than a step of the cheaper kinds. For the shorter fractions the same scratch run is "
        "shown (it has seen a few more steps than they have).",
        "", f"Perplexity: {test} test split, per BPE token, sliding window (stride: half the window), as `mhe eval` "
        "computes it; step 0 is the converted model before any training, and `naive init` the mean of the heads "
        "with zero head embeddings."
        + (f" Every trained run is also scored per word, on the same split and on the test split of "
           f"{', '.join(f'`{c}`' for c in args.also_test.split(','))} (`data.task_options.also_test`): the second "
           "table." if args.also_test else "")]


def portable_command(argv: list[str]) -> str:
    """The command as run from the repository root, with no path of this machine: paths under
    the repository relative to it, an absolute ``--data-dir`` as ``$MHE_DATA``."""
    words, prev = [], ""
    for a in argv:
        if prev == "--data-dir" and os.path.isabs(a):
            words.append('"$MHE_DATA"')
        elif os.path.isabs(a) and Path(a).resolve().is_relative_to(ROOT):
            words.append(shlex.quote(os.path.relpath(a, ROOT)))
        else:
            words.append(shlex.quote(a))
        prev = a
    return "python benchmarks/uptrain.py study " + " ".join(words)


def _max_len(args) -> int:
    for item in args.model_set:
        if item.startswith("model.max_len="):
            return int(item.split("=", 1)[1])
    from mhe.models import preset

    return preset(args.preset).max_len
