"""The uptraining studies: a pre-trained MHA decoder converted to cheaper kinds and trained briefly.

    python benchmarks/uptrain.py study --data-dir DATA --out results/uptrain-NAME
    python benchmarks/uptrain.py methods --data-dir DATA --out results/uptrain-llama-6x512/methods

Each subcommand's module under ``benchmarks/uptraining/`` says what it runs and what it writes;
the runs (``jobs.py``), the stages (``stages.py``) and the report (``report.py``) are shared.
"""

from __future__ import annotations

import sys

from toolbox import run_subcommand

SUBCOMMANDS = {
    "study": ("uptraining.study", "pre-train MHA, convert to each kind, uptrain, compare with scratch "
                                  "(results/uptrain-*/)"),
    "methods": ("uptraining.methods", "conversion and uptraining methods for rotary MHE (output fit, "
                                      "psi-then-rope, distillation) over every GPU"),
}


def main(argv: list[str] | None = None) -> int:
    return run_subcommand("uptrain.py", __doc__.split("\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
