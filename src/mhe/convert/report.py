"""What a conversion reports: per sublayer and role, the fit's relative reconstruction error
beside the naive initialisation's, and (filled in by the run-level conversion) the score of the
source and of the converted model before any training."""

from __future__ import annotations

from dataclasses import dataclass, field

ROLE_NAMES = {"q": "query", "k": "key", "v": "value", "qk": "logits", "vo": "value-output"}


@dataclass
class ConversionReport:
    """``layers``: (sublayer name, ``{role: {"weight": (fitted, naive), "output": (fitted,
    naive)}}``) in model order (see :class:`mhe.convert.sublayer.SublayerResult`); ``scores``:
    ``{"source": {...}, "converted": {...}}`` once evaluated."""

    source: str
    kind: str
    layers: list
    options: dict = field(default_factory=dict)
    scores: dict = field(default_factory=dict)

    def has_output_errors(self) -> bool:
        return any("output" in e for _, errs in self.layers for e in errs.values())

    def error_table(self, space: str = "weight") -> tuple[list[str], list[list[str]]]:
        """Headers and rows: one row per sublayer, per role the relative error in percent of the
        fit beside the naive initialisation's (``space``: ``weight`` or ``output``)."""
        heads = ["sublayer"] + [f"{name}: fit / mean (%)" for name in ROLE_NAMES.values()]
        rows = []
        for name, errs in self.layers:
            cells = [f"{100 * errs[r][space][0]:.1f} / {100 * errs[r][space][1]:.1f}" if space in errs[r] else "—"
                     for r in ROLE_NAMES]
            rows.append([name, *cells])
        return heads, rows

    def mean_errors(self) -> dict[str, dict[str, float]]:
        """Per role, the mean over sublayers of each error (``weight_fit``, ``weight_naive``,
        ``output_fit``, ``output_naive``)."""
        out: dict[str, dict[str, float]] = {}
        for role in ROLE_NAMES:
            acc: dict[str, list[float]] = {}
            for _, errs in self.layers:
                for space, (fit, naive) in errs[role].items():
                    acc.setdefault(f"{space}_fit", []).append(fit)
                    acc.setdefault(f"{space}_naive", []).append(naive)
            out[role] = {k: sum(v) / len(v) for k, v in acc.items()}
        return out

    def to_dict(self) -> dict:
        return {"source": self.source, "kind": self.kind, "options": self.options,
                "errors": [{"sublayer": name, **{ROLE_NAMES[r]: {s: {"fit": f, "naive": n} for s, (f, n) in e.items()}
                                                 for r, e in errs.items()}} for name, errs in self.layers],
                "mean_errors": {ROLE_NAMES[r]: v for r, v in self.mean_errors().items()},
                "scores": self.scores}
