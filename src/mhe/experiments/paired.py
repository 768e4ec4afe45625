"""Which differences between a comparison's rows exceed their seeds' spread: a paired t-test
across seeds. Seed s of one kind is paired with seed s of the other (the same seed draws the same
data order, so the pair differs by the kind and its initialisation); the test asks whether the
mean of the per-seed differences is far from zero given how much those differences vary.

With 3 seeds the test has 2 degrees of freedom: a difference is called clear at p < 0.05 only
when its mean is more than 4.3 times its standard error, so a small seed count errs towards
"within the spread". Each row also says whether the mean difference is larger than both rows'
own standard deviations (the reading's plainer test).
"""

from __future__ import annotations

import math
import statistics

ALPHA = 0.05
"""The two-sided level at which a paired difference is called clear."""


def paired_t(a: list[float], b: list[float]) -> dict:
    """The paired t-test of ``a - b`` (equal lengths, at least 2): ``mean`` and ``std`` of the
    differences, ``t``, ``df`` and the two-sided ``p`` (Student's t distribution). A zero spread
    of the differences gives t = ±inf and p = 0 when the mean is not zero, else t = 0 and p = 1."""
    from scipy import stats

    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"a paired test needs two lists of one length >= 2, got {len(a)} and {len(b)}")
    d = [x - y for x, y in zip(a, b)]
    mean, sd, n = statistics.fmean(d), statistics.stdev(d), len(d)
    if sd == 0:
        t = 0.0 if mean == 0 else math.copysign(math.inf, mean)
        p = 1.0 if mean == 0 else 0.0
    else:
        t = mean / (sd / math.sqrt(n))
        p = float(2 * stats.t.sf(abs(t), n - 1))
    return {"mean": mean, "std": sd, "t": t, "df": n - 1, "p": p}


def paired_rows(rows: list[dict], *, higher_is_better: bool) -> list[dict]:
    """Every pair of summary rows (``kind``, ``scores`` in seed order, ``std``) with at least two
    seeds in common: the paired test of the first minus the second, whether it is clear at
    :data:`ALPHA`, whether the mean difference exceeds both rows' spreads, and which row is better."""
    out = []
    for i, r in enumerate(rows):
        for s in rows[i + 1:]:
            n = min(len(r["scores"]), len(s["scores"]))
            if n < 2:
                continue
            test = paired_t(r["scores"][:n], s["scores"][:n])
            better = r["kind"] if (test["mean"] > 0) == higher_is_better else s["kind"]
            out.append({"a": r["kind"], "b": s["kind"], "n": n, **test, "clear": test["p"] < ALPHA,
                        "beyond_spreads": abs(test["mean"]) > max(r["std"], s["std"]),
                        "better": better if test["mean"] != 0 else None})
    return out


def markdown(pairs: list[dict], label=str, metric: str = "") -> list[str]:
    """The table of :func:`paired_rows` (the clear differences first, then by size)."""
    lines = [f"Paired differences across seeds{f' ({metric})' if metric else ''}: A minus B, seed s with seed s; "
             f"p of a paired t-test (two-sided); clear at p < {ALPHA:g}; 'beyond spreads': the mean difference is "
             "larger than both rows' standard deviations.", "",
             "| A | B | seeds | mean A - B | std of differences | t | p | clear | beyond spreads | better |",
             "|---|---|---:|---:|---:|---:|---:|---|---|---|"]
    for p in sorted(pairs, key=lambda p: (not p["clear"], -abs(p["mean"]))):
        lines.append(f"| {label(p['a'])} | {label(p['b'])} | {p['n']} | {p['mean']:+.4g} | {p['std']:.3g} | "
                     f"{p['t']:.2f} | {p['p']:.3f} | {'yes' if p['clear'] else 'no'} | "
                     f"{'yes' if p['beyond_spreads'] else 'no'} | {label(p['better']) if p['better'] else '-'} |")
    return lines
