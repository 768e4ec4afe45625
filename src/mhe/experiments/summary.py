"""Aggregate finished runs into the paper's table shape: score ± std, attention
parameters, PRR against MHA and PEoP against SHA (section 4.6); Markdown, CSV,
JSON and plots. A row is a kind, or a kind and its rotary order
(:func:`mhe.experiments.entries.row_name`); a comparison may also tabulate further numbers of
every ``results.json`` (``also``: another test set) and each row's KV cache per token."""

from __future__ import annotations

import csv
import dataclasses
import functools
import json
import statistics
from pathlib import Path

from mhe.accounting import model_attention_params
from mhe.accounting.memory import decoder_memory
from mhe.attention import KINDS, PAPER_KINDS
from mhe.data.benchmarks import BENCH_TASKS as BENCH
from mhe.data.corpora import CORPORA
from mhe.errors import MheError
from mhe.attention.mhe import ROPE_ORDERS
from mhe.experiments.entries import row_name
from mhe.experiments.paired import markdown as paired_markdown
from mhe.experiments.paired import paired_rows
from mhe.experiments.paper import paper_table, source
from mhe.experiments.run_archive import RunFiles
from mhe.experiments.plots import label, plot_curves, plot_prr_vs_paper, plot_score_vs_params
from mhe.metrics import peop, prr
from mhe.models import ModelConfig, preset
from mhe.training.checkpoint import write_json_atomic, write_text_atomic

ORDER = list(PAPER_KINDS) + [k for k in KINDS if k not in PAPER_KINDS]

PRR_BASE = "mha"
"""The row PRR is relative to: the paper's performance retention ratio is a kind's score against MHA's."""
PEOP_BASE = "sha"
"""The row PEoP is relative to: the paper's elasticity of parameters is measured against SHA."""


def collect(out: Path, *, kv_cache: bool = False) -> list[dict]:
    """Every finished run's results.json under ``out/runs`` (or packed in ``out/runs.tar.xz``),
    with its row name and (``kv_cache``, a decoder) its KV cache per token, both from the run's
    ``config.json`` where it has one, and its training log (``training_log``: read when drawn)."""
    files = RunFiles(out)
    runs = []
    for name in files.finished():
        r = files.results(name)
        r["run_dir"] = str(out / "runs" / name)  # the same in either form: reports do not differ
        r.update(_from_config(files.config(name), kv_cache))
        r["training_log"] = functools.partial(files.metrics, name)
        runs.append(r)
    return runs


def _from_config(record: dict | None, kv_cache: bool) -> dict:
    """``row`` and ``kv_cache_bytes_per_token`` (bf16) of a run's resolved model (its
    ``config.json``'s ``model``; None: a run without one)."""
    model = (record or {}).get("model")
    if not isinstance(model, dict) or "attention" not in model:
        return {}
    out = {"row": row_name(model)}
    if kv_cache and model.get("arch") == "decoder":
        names = {fl.name for fl in dataclasses.fields(ModelConfig)}
        cfg = ModelConfig(**{k: v for k, v in model.items() if k in names})
        out["kv_cache_bytes_per_token"] = decoder_memory(cfg)["kv_cache_bytes_per_token"]
    return out


LOWER_IS_BETTER = ("perplexity", "word_perplexity", "loss", "mlm_loss", "nll")  # and their _strideN forms


def _lower_is_better(metric: str) -> bool:
    """Whether a results.json number is better lower: a perplexity, loss or NLL, also of another
    test set (``ptb_word_perplexity``, lm's ``also_test``)."""
    for corpus in CORPORA:
        metric = metric.removeprefix(f"{corpus}_")
    return metric.startswith(LOWER_IS_BETTER)


def aggregate(runs: list[dict], metric: str | None = None) -> dict:
    """``{"task", "metric", "higher_is_better", "rows": [...]}`` with PRR and PEoP per kind.

    ``metric`` summarises another number every ``results.json`` holds (MRPC's accuracy beside
    its F1, say) instead of the score the runs were selected on."""
    if not runs:
        raise MheError("no finished runs to summarise (no runs/*/results.json)")
    primary, hib, task = runs[0]["metric"], runs[0]["higher_is_better"], runs[0]["task"]
    by_kind: dict[str, list[dict]] = {}
    for r in runs:
        if r["metric"] != primary:
            raise MheError(f"runs mix metrics {primary!r} and {r['metric']!r}")
        by_kind.setdefault(r.get("row") or r["attention"], []).append(r)
    key = "score"
    if metric and metric != primary:
        for r in runs:
            if not isinstance(r.get(metric), (int, float)) or isinstance(r.get(metric), bool):
                numbers = sorted(k for k, v in r.items() if isinstance(v, float) and k != "score")
                raise MheError(f"run {r.get('run_dir', r['attention'])} has no metric {metric!r}; "
                               f"valid: {', '.join(numbers)}")
        key, hib = metric, not _lower_is_better(metric)
    metric = metric or primary
    rows = []
    for kind in sorted(by_kind, key=_order):
        scores = [r[key] for r in sorted(by_kind[kind], key=lambda r: r.get("seed", 0))]
        first = by_kind[kind][0]
        rows.append({"kind": kind, "attention_params": first["attention_params"],
                     "mean": statistics.fmean(scores), "std": statistics.stdev(scores) if len(scores) > 1 else 0.0,
                     "n_seeds": len(scores), "scores": scores, "prr": None, "peop": None,
                     **({"kv_cache_bytes_per_token": first["kv_cache_bytes_per_token"]}
                        if "kv_cache_bytes_per_token" in first else {})})
    ref = {r["kind"]: r for r in rows}
    for row in rows:
        if PRR_BASE in ref and ref[PRR_BASE]["mean"] != 0:
            row["prr"] = prr(row["mean"], ref[PRR_BASE]["mean"], higher_is_better=hib)
        if PEOP_BASE in ref and row["kind"] != PEOP_BASE:
            row["peop"] = _safe_peop(row["mean"], row["attention_params"], ref[PEOP_BASE]["mean"],
                                     ref[PEOP_BASE]["attention_params"], hib)
    out = {"task": task, "metric": metric, "higher_is_better": hib, "rows": rows}
    if metric.startswith("perplexity") and runs[0].get("perplexity_per"):
        out["perplexity_per"] = runs[0]["perplexity_per"]  # word or token: the unit every table names
    return out


def _order(name: str) -> tuple:
    """Rows in the paper's order of kinds, a kind's rotary orders after one another (the default,
    ``rope-then-psi``, first)."""
    kind, _, variant = name.partition(" ")
    return (ORDER.index(kind) if kind in ORDER else len(ORDER),
            ROPE_ORDERS.index(variant) if variant in ROPE_ORDERS else -1, name)


def _safe_peop(score, params, sha_score, sha_params, hib):
    """PEoP, or None where it is undefined (SHA's size, or a zero SHA score)."""
    try:
        return peop(score, params, sha_score, sha_params, higher_is_better=hib)
    except MheError:
        return None


def paper_columns(summary: dict, table: str) -> dict:
    """The paper's score, PRR and PEoP per kind, recomputed from the printed numbers."""
    t = paper_table(table)
    hib = t["higher_is_better"]
    scale = 0.01 if t.get("percent") else 1.0  # printed as percentages; our scores are fractions
    rows = {k: (params_m, score * scale) for k, (params_m, score) in t["rows"].items()}
    c = preset(t["params_from"])
    exact = {k: model_attention_params(k, arch=c.arch, n_layers=c.n_layers, d_model=c.d_model, n_heads=c.n_heads)
             for k in rows}
    out = {}
    for kind, (params_m, score) in rows.items():
        col = {"params_m": params_m, "params": exact[kind], "score": score, "prr": None, "peop": None}
        if PRR_BASE in rows:
            col["prr"] = prr(score, rows[PRR_BASE][1], higher_is_better=hib)
        if PEOP_BASE in rows and kind != PEOP_BASE and params_m is not None:  # no printed size (FNet, Linear): no PEoP
            col["peop"] = _safe_peop(score, exact[kind], rows[PEOP_BASE][1], exact[PEOP_BASE], hib)
        out[kind] = col
    return {"table": table, "metric": t["metric"], "rows": out, "percent": bool(t.get("percent"))}


def _label(kind: str) -> str:
    """The paper's name for a kind (EL-att, MHE-Add, MHE-Mul, ...), as its tables print it, and
    a row's rotary order after it."""
    return label(kind)


def _fmt(x, digits=4):
    if x is None:
        return "-"
    return f"{x:.{digits}g}" if abs(x) < 1000 else f"{x:,.1f}"


def _mean_std(mean, std, n_seeds: int, mean_text: str, std_text: str) -> str:
    """``mean ± std``, or the mean alone where one seed gives no spread."""
    return f"{mean_text} ± {std_text}" if n_seeds > 1 else mean_text


def metric_label(summary: dict) -> str:
    """The metric's name with its unit where it has one (``perplexity per word`` / ``per token``)."""
    m = summary["metric"]
    if m.startswith("word_perplexity"):
        return m.replace("word_perplexity", "perplexity per word")
    per = summary.get("perplexity_per")
    return m.replace("perplexity", f"perplexity per {per}") if per else m


def _table(rows: list[dict], metric: str, paper: dict | None, kv_cache: bool) -> list[str]:
    """One Markdown table of summary rows (with the paper's columns, and the KV cache column)."""
    head = ["Attention", "#params"] + (["KV cache / token (bf16)"] if kv_cache else []) + [
        f"{metric} (mean ± std)", "seeds", "PRR (%)", "PEoP"]
    if paper:
        head += [f"paper {paper['metric']}", "paper PRR (%)", "paper PEoP"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in rows:
        kv = r.get("kv_cache_bytes_per_token")
        cells = [_label(r["kind"]), f"{r['attention_params'] / 1e6:.3f}M"] + (
            ["-" if kv is None else f"{kv:,} B"] if kv_cache else []) + [
                 _mean_std(r["mean"], r["std"], r["n_seeds"], _fmt(r["mean"]), _fmt(r["std"], 2)), str(r["n_seeds"]),
                 "-" if r["prr"] is None else f"{100 * r['prr']:.1f}", "-" if r["peop"] is None else f"{r['peop']:.2f}"]
        if paper:
            p = paper["rows"].get(r["kind"])
            cells += ["-", "-", "-"] if p is None else [
                f"{p['score']:g}", "-" if p["prr"] is None else f"{100 * p['prr']:.1f}",
                "-" if p["peop"] is None else f"{p['peop']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(summary: dict, paper: dict | None = None) -> str:
    """The summary's table (and one table per ``also`` number), then what the columns mean."""
    m, kv = summary["metric"], bool(summary.get("kv_cache"))
    lines = _table(summary["rows"], metric_label(summary), paper, kv)
    if "paired" in summary:
        lines += ["", *_spread_lines(summary["rows"]), "", *paired_markdown(summary["paired"], _label)]
    for other, part in (summary.get("also") or {}).items():
        lines += ["", f"`{other}`:", ""] + _table(part["rows"], other, None, kv)
        if "paired" in part:
            lines += ["", *_spread_lines(part["rows"]), "", *paired_markdown(part["paired"], _label, other)]
    direction = "higher" if summary["higher_is_better"] else "lower"
    lines.append("")
    lines.append(f"Task `{summary['task']}`, metric `{m}` ({direction} is better). PRR against MHA, PEoP against SHA "
                 "(section 4.6); PEoP is inverted for lower-is-better metrics."
                 + (" KV cache: bytes per token of one sequence in bf16 (2 x layers x cached K/V heads x head "
                    "dimension x 2)." if kv else ""))
    if paper:
        lines.append(f"Paper columns: `{paper['table']}` from {source()} PRR/PEoP recomputed from the printed numbers."
                     + (" The paper prints percentages; they are shown here as fractions." if paper.get("percent")
                        else ""))
    return "\n".join(lines) + "\n"


SPREAD_GOAL = 0.02
"""The seed spread a row should stay within, as a share of its mean (issue 60: rows whose seeds agree)."""


def _spread_lines(rows: list[dict]) -> list[str]:
    """Each row's seed spread as a share of its mean, against :data:`SPREAD_GOAL`."""
    cells = [f"{_label(r['kind'])} {100 * r['std'] / abs(r['mean']):.1f}%"
             + ("" if r["std"] <= SPREAD_GOAL * abs(r["mean"]) else " (over)")
             for r in rows if r["n_seeds"] > 1 and r["mean"]]
    return [f"Seed spread (std / mean; goal at most {100 * SPREAD_GOAL:g}%): " + "; ".join(cells) + "."]


def check_paper_matches(summary: dict, table: str, *, metric: bool = True) -> None:
    """Refuse a paper table of another task (and, with ``metric``, of another metric) than
    the comparison's, before anything is written."""
    t = paper_table(table)
    subject = table.split("-", 1)[-1]  # table1-rte -> rte, table2-ptb -> ptb
    if subject in BENCH and subject != summary["task"]:
        raise MheError(f"paper table {table!r} is task {subject!r}, this comparison is {summary['task']!r}; "
                       f"give --paper table1-{summary['task']} or --paper ''")
    ours, theirs = summary["metric"], t["metric"]
    if metric and theirs not in ours and ours not in theirs:  # f1 ~ f1_macro, perplexity ~ word_perplexity
        raise MheError(f"paper table {table!r} reports {t['metric']}, this comparison ({summary['task']}) reports "
                       f"{summary['metric']}; give a table of the same task and metric or --paper ''")


def _paper_metric(table: str) -> str:
    """The metric a paper table reports (``write_summary``'s ``paper_table`` argument hides the function)."""
    return paper_table(table)["metric"]


def write_summary(out: Path, *, paper_table: str = "", metric: str | None = None,
                  strict_paper: bool = False, also: tuple = (), kv_cache: bool = False, paired: bool = False) -> dict:
    """Write summary.json, summary.md, summary.csv and the plots; returns the summary.
    A paper table of another task is refused; with ``strict_paper`` (``mhe report``) also
    one of another metric. ``also``: further numbers of every results.json, each tabulated
    (mean ± std, PRR, PEoP) under ``summary.json``'s ``also``; ``kv_cache``: a KV cache column;
    ``paired``: each row's seed spread and a paired test across seeds of every two rows."""
    runs = collect(out, kv_cache=kv_cache)
    if metric is None and paper_table and runs:
        wanted = _paper_metric(paper_table)  # the paper's metric where every run recorded it (MRPC:
        if wanted != runs[0]["metric"] and all(isinstance(r.get(wanted), float) for r in runs):  # accuracy)
            metric = wanted
    summary = aggregate(runs, metric)
    if kv_cache:
        summary["kv_cache"] = True
    if also:
        summary["also"] = {m: {k: v for k, v in aggregate(runs, m).items() if k != "task"} for m in also}
    if paired:  # paired tests across seeds (mhe.experiments.paired), of the score and of each `also` number
        summary["paired"] = paired_rows(summary["rows"], higher_is_better=summary["higher_is_better"])
        for part in (summary.get("also") or {}).values():
            part["paired"] = paired_rows(part["rows"], higher_is_better=part["higher_is_better"])
    if paper_table:
        check_paper_matches(summary, paper_table, metric=strict_paper)
    paper = paper_columns(summary, paper_table) if paper_table else None
    write_json_atomic(out / "summary.json", {**summary, **({"paper": paper} if paper else {})})
    md = markdown(summary, paper)
    write_text_atomic(out / "summary.md", md)
    tmp = out / ".summary.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.writer(f)
        kv = ["kv_cache_bytes_per_token"] if kv_cache else []
        w.writerow(["kind", "attention_params", *kv, "mean", "std", "n_seeds", "prr", "peop"])
        for r in summary["rows"]:
            w.writerow([r["kind"], r["attention_params"], *(r.get(k) for k in kv), r["mean"], r["std"],
                        r["n_seeds"], r["prr"], r["peop"]])
    tmp.replace(out / "summary.csv")
    plot_score_vs_params(summary, out / "score_vs_params.png")
    if kv_cache:
        plot_score_vs_params(summary, out / "score_vs_kv_cache.png", cost="kv_cache_bytes_per_token")
    plot_curves(runs, out / "training_curves.png")
    if paper:
        rows = [(r["kind"], r["prr"], (paper["rows"].get(r["kind"]) or {}).get("prr")) for r in summary["rows"]]
        plot_prr_vs_paper(rows, f"{summary['task']}: PRR, ours against {paper['table']}", out / "prr_vs_paper.png")
    return {**summary, "markdown": md}


def overview(dirs: list[Path], plot: Path | None = None) -> str:
    """One table over several comparisons (the shape of the paper's Table 1): each task's mean
    per kind, their average, and PRR / PEoP of that average; the paper's average over the same
    tasks beside it where every task has a paper column. Reads each folder's summary.json.
    ``plot``: also draw the PRR of the averages, ours beside the paper's."""
    summaries = []
    for d in dirs:
        f = Path(d) / "summary.json"
        if not f.exists():
            raise MheError(f"{d} has no summary.json; run `mhe report {d}` first")
        summaries.append(json.loads(f.read_text()))
    paper_hib = _check_overview_directions(dirs, summaries)
    kinds = [r["kind"] for r in summaries[0]["rows"]]
    kinds = [k for k in kinds if all(any(r["kind"] == k for r in s["rows"]) for s in summaries)]
    if not kinds:
        raise MheError("the comparisons share no attention kind")
    # a column per comparison: its task, or its folder where two share a task (PTB and WikiText-2 are both lm)
    names = [s["task"] for s in summaries]
    tasks = [t if names.count(t) == 1 else Path(d).name for t, d in zip(names, dirs)]
    cell = {(t, r["kind"]): r for t, s in zip(tasks, summaries) for r in s["rows"]}
    params = {r["kind"]: r["attention_params"] for r in summaries[0]["rows"]}
    hib = summaries[0]["higher_is_better"]
    avg = {k: statistics.fmean(cell[(t, k)]["mean"] for t in tasks) for k in kinds}
    with_paper = all("paper" in s for s in summaries)
    paper_avg = {}
    if with_paper:
        for k in kinds:
            scores = [s["paper"]["rows"].get(k, {}).get("score") for s in summaries]
            if all(x is not None for x in scores):
                paper_avg[k] = statistics.fmean(scores)
    head = ["Attention", "#params"] + [f"{t} ({metric_label(s)})" for t, s in zip(tasks, summaries)] + [
        "average", "PRR (%)", "PEoP"]
    if paper_avg:
        head += ["paper average", "paper PRR (%)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    prr_rows = []
    for k in kinds:
        cells = [_label(k), f"{params[k] / 1e6:.3f}M"]
        cells += [_mean_std(c["mean"], c["std"], c["n_seeds"], f"{c['mean']:.4f}", f"{c['std']:.3f}")
                  for c in (cell[(t, k)] for t in tasks)]
        r = prr(avg[k], avg[PRR_BASE], higher_is_better=hib) if PRR_BASE in avg else None
        e = (_safe_peop(avg[k], params[k], avg[PEOP_BASE], params[PEOP_BASE], hib)
             if PEOP_BASE in avg and k != PEOP_BASE else None)
        cells += [f"{avg[k]:.4f}", "-" if r is None else f"{100 * r:.1f}", "-" if e is None else f"{e:.2f}"]
        if paper_avg:
            pr = (prr(paper_avg[k], paper_avg[PRR_BASE], higher_is_better=paper_hib)
                  if k in paper_avg and PRR_BASE in paper_avg else None)
            cells += [f"{paper_avg[k]:.4f}" if k in paper_avg else "-", "-" if pr is None else f"{100 * pr:.1f}"]
            prr_rows.append((k, r, pr))
        lines.append("| " + " | ".join(cells) + " |")
    if plot is not None:
        if not prr_rows:
            raise MheError("--plot needs a paper column for every task (mhe report DIR --paper TABLE)")
        plot_prr_vs_paper(prr_rows, f"{', '.join(tasks)}: PRR of the average, ours against the paper", plot)
    lines.append("")
    lines.append(f"Mean ± std over seeds per task; the average is the unweighted mean of the {len(tasks)} task "
                 "means. PRR against MHA and PEoP against SHA are computed from the averages (section 4.6)."
                 + (f" Paper: the same tasks' {_paper_tables(summaries)} scores, averaged." if paper_avg else ""))
    return "\n".join(lines) + "\n"


def _paper_tables(summaries: list[dict]) -> str:
    """The paper tables the summaries set beside ours, as printed: 'Table 1', 'Table 2' or both."""
    names = sorted({s["paper"]["table"].split("-")[0].removeprefix("table") for s in summaries})
    return " and ".join(f"Table {n}" for n in names)


def _check_overview_directions(dirs: list[Path], summaries: list[dict]) -> bool | None:
    """Refuse comparisons whose metrics point different ways (an average of perplexities and
    accuracies means nothing) and paper columns of another task or metric than their
    comparison's; returns the paper tables' direction (``None`` without paper columns), which
    PRR of the paper's averages follows (section 4.6: the inverse formula for perplexity)."""
    directions = {bool(s["higher_is_better"]) for s in summaries}
    if len(directions) > 1:
        ways = ", ".join(f"{d} ({s['metric']}, {'higher' if s['higher_is_better'] else 'lower'} is better)"
                         for d, s in zip(dirs, summaries))
        raise MheError(f"the comparisons' metrics point different ways: {ways}; give comparisons of one direction")
    for d, s in zip(dirs, summaries):
        if "paper" in s:
            try:
                check_paper_matches(s, s["paper"]["table"])
            except MheError as e:
                raise MheError(f"{d}: {e} (then `mhe report {d} --paper TABLE`)") from None
    paper = {bool(paper_table(s["paper"]["table"])["higher_is_better"]) for s in summaries if "paper" in s}
    return paper.pop() if len(paper) == 1 else None


def metric_means(results: list[dict]) -> dict:
    """Mean and sample std over seeds of every official metric the runs report
    (``official_metrics``, fine-tuning), e.g. MRPC's accuracy (the headline) and F1; one seed
    gives no std."""
    names = results[0].get("official_metrics") or []
    out = {}
    for m in names:
        vals = [r[m] for r in results if isinstance(r.get(m), (int, float))]
        if len(vals) == len(results):
            out[m] = {"mean": statistics.fmean(vals), **({"std": statistics.stdev(vals)} if len(vals) > 1 else {})}
    return out
