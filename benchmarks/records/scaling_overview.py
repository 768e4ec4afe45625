"""PRR against model size from the ``results/scale-*`` comparisons (Appendix D on one GPU).

    python benchmarks/results_tools.py scaling-overview [RESULTS_DIR] [--out FILE.md] [--plot FILE.png]

For each corpus and size: MHA's and each MHE variant's test perplexity (mean ± std over
seeds), PRR of the means (section 4.6: 1 - (ppl - ppl_MHA) / ppl_MHA) and the spread of the
per-seed PRR (seed s of a kind against seed s of MHA), the validation step each run stopped
at, and how many runs reached the step horizon instead of stopping early. Beside it, the
paper's Appendix D rows (GPT-2 base and medium on WikiText-103 and PTB).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mhe.experiments.paper import appendix_table
from mhe.experiments.presets import SCALING_SIZES
from mhe.metrics import prr
from mhe.experiments.run_archive import RunFiles

CORPORA = {"ptb": "PTB (per word)", "wikitext-2": "WikiText-2 (per BPE token)"}
PAPER_COLUMN = {"ptb": "ptb", "wikitext-2": "wikitext-103"}
VARIANTS = ("mhe-mul", "mhe-add")


def _runs(folder: Path) -> dict[str, dict[int, dict]]:
    """``{kind: {seed: results}}`` of the finished runs in one comparison folder."""
    out: dict[str, dict[int, dict]] = {}
    files = RunFiles(folder)  # runs/ or runs.tar.xz
    for name in files.finished():
        r = files.results(name)
        out.setdefault(r["attention"], {})[r["seed"]] = r
    return out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def rows(results: Path) -> list[dict]:
    """One row per (corpus, size, MHE variant) with finished MHA and variant runs."""
    table = []
    for data in CORPORA:
        for size, shape in SCALING_SIZES.items():
            runs = _runs(results / f"scale-{data}-{size}")
            mha = runs.get("mha", {})
            for kind in VARIANTS:
                var = runs.get(kind, {})
                if not mha or not var:
                    continue
                paired = sorted(set(mha) & set(var))
                mha_mean, mha_std = _mean_std([r["score"] for r in mha.values()])
                var_mean, var_std = _mean_std([r["score"] for r in var.values()])
                per_seed = [prr(var[s]["score"], mha[s]["score"], higher_is_better=False) for s in paired]
                done = list(mha.values()) + list(var.values())
                table.append({
                    "data": data, "size": size, **shape, "kind": kind,
                    "mha_params": next(iter(mha.values()))["attention_params"],
                    "kind_params": next(iter(var.values()))["attention_params"],
                    "mha": (mha_mean, mha_std, len(mha)), "variant": (var_mean, var_std, len(var)),
                    "prr": prr(var_mean, mha_mean, higher_is_better=False),
                    "prr_seeds": _mean_std(per_seed) if per_seed else None,
                    "steps": statistics.fmean(r["step"] for r in done),
                    "at_horizon": sum(r["status"] == "finished" for r in done), "runs": len(done)})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| corpus | size | MHA attention params | MHA perplexity | kind | its perplexity | PRR (%) "
             "| per-seed PRR (%) | mean stop step | runs at the horizon |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in table:
        m, v = r["mha"], r["variant"]
        seeds = f"{100 * r['prr_seeds'][0]:.1f} ± {100 * r['prr_seeds'][1]:.1f}" if r["prr_seeds"] else "-"
        lines.append(f"| {CORPORA[r['data']]} | {r['size']} ({r['d_model']}, {r['n_layers']} layers, "
                     f"{r['n_heads']} heads) | {r['mha_params'] / 1e6:.2f}M | {m[0]:.1f} ± {m[1]:.1f} ({m[2]}) "
                     f"| {r['kind']} | {v[0]:.1f} ± {v[1]:.1f} ({v[2]}) | {100 * r['prr']:.1f} | {seeds} "
                     f"| {r['steps']:.0f} | {r['at_horizon']} of {r['runs']} |")
    paper = appendix_table("D-size-scaling")["rows"]
    lines += ["", "Paper (Appendix D, MHE-Mul against MHA):", "",
              "| model | WikiText-103 MHA | MHE-Mul | PRR (%) | PTB MHA | MHE-Mul | PRR (%) |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("decoder-base", "decoder-medium"):
        row = paper[name]
        cells = []
        for col in ("wikitext-103", "ptb"):
            c = row[col]
            cells += [f"{c['mha']}", f"{c['mhe-mul']}", f"{100 * prr(c['mhe-mul'], c['mha'], higher_is_better=False):.1f}"]
        lines.append(f"| GPT-2 {name.split('-')[1]} ({row['params_m']['mha']}M attention) | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for data in CORPORA:
        for kind, marker in zip(VARIANTS, "os"):
            pts = [r for r in table if r["data"] == data and r["kind"] == kind]
            if pts:
                ax.errorbar([r["mha_params"] / 1e6 for r in pts], [100 * r["prr"] for r in pts],
                            yerr=[100 * r["prr_seeds"][1] if r["prr_seeds"] else 0 for r in pts],
                            marker=marker, capsize=3, label=f"{kind}, {data}")
    paper = appendix_table("D-size-scaling")["rows"]
    for col in ("wikitext-103", "ptb"):
        xs = [paper[n]["params_m"]["mha"] for n in ("decoder-base", "decoder-medium")]
        ys = [100 * prr(paper[n][col]["mhe-mul"], paper[n][col]["mha"], higher_is_better=False)
              for n in ("decoder-base", "decoder-medium")]
        ax.plot(xs, ys, linestyle="--", marker="x", label=f"paper mhe-mul, {col}")
    ax.set_xscale("log")
    ax.set_xlabel("MHA attention parameters (millions)")
    ax.set_ylabel("PRR (%)")
    ax.axhline(100, color="grey", linewidth=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="results_tools.py scaling-overview", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="?", default="results")
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    table = rows(Path(args.results))
    md = markdown(table)
    print(md)
    if args.out:
        Path(args.out).write_text(md)
    if args.plot:
        plot(table, Path(args.plot))
    return 0

