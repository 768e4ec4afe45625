"""Tools over the run folders under results/: old layouts brought up to date, the scaling overview, the recall grid's records.

    python benchmarks/results_tools.py migrate DIR [DIR ...]
    python benchmarks/results_tools.py scaling-overview [RESULTS_DIR] [--out FILE.md] [--plot FILE.png]
    python benchmarks/results_tools.py recall-escape results/recall-zoology [--archive FILE.tar.xz [--per-run]] [--out FILE.md]
    python benchmarks/results_tools.py recall-escape results/recall-zoology --by-entry [--length N] [--out FILE.md]
    python benchmarks/results_tools.py recall-times results/recall-zoology [--log FILE --calls A[-B]] [--out FILE.md]

The parts live under ``benchmarks/records/``.
"""

from __future__ import annotations

import sys

from toolbox import run_subcommand

SUBCOMMANDS = {
    "migrate": ("records.migrate", "rewrites run folders of earlier layouts into today's, in place"),
    "scaling-overview": ("records.scaling_overview", "PRR against model size from the results/scale-* comparisons"),
    "recall-escape": ("records.recall_escape", "the steps at which a recall grid's runs left the plateau, per cell"),
    "recall-times": ("records.recall_times", "how long a recall grid's runs took a step and a run, per cell"),
}


def main(argv: list[str] | None = None) -> int:
    return run_subcommand("results_tools.py", __doc__.split("\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
