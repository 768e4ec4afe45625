"""The comparison's pictures: score against attention parameters, training curves, and PRR
beside the paper's."""

from __future__ import annotations

from pathlib import Path

from mhe.accounting.scaling import COLOURS
from mhe.accounting.scaling import LABELS as _SCALING_LABELS
from mhe.training.run_files import read_metrics

LABELS = {**_SCALING_LABELS, "mhe-mul": "MHE-Mul"}  # both MHE variants appear side by side here
KIND_COLORS = {"mha": "#1f77b4", "sha": "#7f7f7f", "mqa": "#2ca02c", "gqa": "#17becf", "skv": "#9467bd",
               "el-att": "#8c564b", "mhe-add": "#ff7f0e", "mhe-mul": "#d62728", "fnet": "#bcbd22",
               "linear": "#e377c2"}
"""One colour per attention kind (matplotlib's tab10), for every plot that shows kinds."""


def label(name: str) -> str:
    """A row's name as the paper prints the kind (MHE-Mul), a rotary order after it
    (``mhe-mul psi-then-rope`` -> ``MHE-Mul psi-then-rope``)."""
    kind, _, variant = name.partition(" ")
    return f"{LABELS.get(kind, kind)} {variant}".strip()


def _colour(name: str):
    """A row's colour: its kind's (two rotary orders of one kind share it; the marker differs)."""
    return COLOURS.get(name.split(" ", 1)[0])


def _marker(name: str) -> str:
    return "s" if name.endswith("psi-then-rope") else "o"


def kind_color(kind: str) -> str:
    """The plot colour of an attention kind (:data:`KIND_COLORS`; black for anything else)."""
    return KIND_COLORS.get(kind, "black")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_score_vs_params(summary: dict, path: Path, *, cost: str = "attention_params") -> None:
    """The paper's argument in one picture: what each kind scores for what it costs (``cost``:
    its attention parameters, or ``kv_cache_bytes_per_token``, where two rotary orders of MHE
    part)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in summary["rows"]:
        x = max(r.get(cost) or 0, 1)
        spread = [r["std"]] if r["n_seeds"] > 1 else None  # no bar where one seed gives no spread
        ax.errorbar([x], [r["mean"]], yerr=spread, fmt=_marker(r["kind"]), ms=8, capsize=4, color=_colour(r["kind"]),
                    label=label(r["kind"]))
        below = r["kind"].endswith("psi-then-rope")  # beside its rope-then-psi twin of the same size: below it
        ax.annotate(label(r["kind"]), (x, r["mean"]), textcoords="offset points", xytext=(6, -12 if below else 4))
    ax.set_xscale("log")
    ax.set_xlabel("attention parameters (log scale)" if cost == "attention_params" else
                  "KV cache per token, bytes in bf16 (log scale)")
    direction = "higher" if summary["higher_is_better"] else "lower"
    ax.set_ylabel(f"{summary['metric']} ({direction} is better)")
    ax.set_title(f"{summary['task']}: score against " + ("attention parameters" if cost == "attention_params"
                                                         else "KV cache per token"))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def smooth(values: list[float], parts: int = 40) -> list[float]:
    """Trailing running mean over ``len(values) // parts`` points (at least 1): fine-tuning logs
    a loss every 10 steps of 32 examples, too noisy to compare kinds by eye."""
    w = max(1, len(values) // parts)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= w:
            total -= values[i - w]
        out.append(total / min(i + 1, w))
    return out


def plot_curves(runs: list[dict], path: Path) -> None:
    """Training loss per row (the first seed of each kind, or kind and rotary order)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    seen = set()
    for r in sorted(runs, key=lambda r: (r.get("row") or r["attention"], r.get("seed", 0))):
        name = r.get("row") or r["attention"]
        if name in seen:
            continue
        seen.add(name)
        if callable(r.get("training_log")):  # collect's: the run's log from its folder or its archive
            recs = r["training_log"]()
        else:
            f = Path(r["run_dir"]) / "metrics.jsonl"
            recs = read_metrics(f) if f.exists() else None
        if recs is None:
            continue
        recs = [x for x in recs if "loss" in x]
        steps, loss = [x["step"] for x in recs], smooth([x["loss"] for x in recs])
        ax.plot(steps, loss, label=label(name), color=_colour(name),
                linestyle="--" if name.endswith("psi-then-rope") else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (running mean over ~1/40 of the run)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if ax.get_lines():
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no training logs (metrics.jsonl)", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_prr_vs_paper(rows: list[tuple[str, float | None, float | None]], title: str, path: Path) -> None:
    """PRR (share of MHA's score kept, section 4.6) per kind: ours beside the paper's.
    ``rows``: (kind, our PRR, paper PRR) with PRR as a fraction; None where undefined."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = range(len(rows))
    ours = [100 * r[1] if r[1] is not None else 0 for r in rows]
    paper = [100 * r[2] if r[2] is not None else 0 for r in rows]
    colours = [_colour(r[0]) for r in rows]  # each kind's colour; the paper's bars hatched
    ax.bar([x - 0.2 for x in xs], ours, width=0.4, color=colours, edgecolor="black", label="ours")
    ax.bar([x + 0.2 for x in xs], paper, width=0.4, color=colours, alpha=0.45, hatch="//", edgecolor="black",
           label="paper")
    ax.axhline(100, color="black", lw=0.8)
    ax.set_xticks(list(xs), [label(r[0]) for r in rows])
    low = min([v for v in ours + paper if v > 0] + [100])
    ax.set_ylim(max(0, low - 10), max(ours + paper + [100]) + 5)
    ax.set_ylabel("PRR (% of MHA's score)")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
