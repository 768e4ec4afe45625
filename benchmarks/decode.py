"""Decoding on real hardware, one subcommand each (a module of ``benchmarks/decoding/``).

    python benchmarks/decode.py SUBCOMMAND [ARGS ...]
    python benchmarks/decode.py SUBCOMMAND --help

Every subcommand but ``rows`` and ``beam`` measures this checkout's ``src`` (found through
``toolbox``); those two measure the tree on ``PYTHONPATH``, so an older tree can run them
(``speed --old-src`` runs ``rows`` so).
"""

from __future__ import annotations

import sys

from subcommands import run_subcommand

SUBCOMMANDS = {
    "floor": ("decoding.floor", "a decode step of the Llama presets against the bytes it must read; prefill share; "
                                "the largest batch at a context (--sections server)"),
    "census": ("decoding.census", "the kernels of one compiled decode step, per layer and per kind"),
    "prefill": ("decoding.prefill", "a long prompt's prefill alone: its share of the card's peak bf16 throughput"),
    "anchor": ("decoding.anchor", "FlashInfer's batch decode kernel beside mhe's on the same caches"),
    "speed": ("decoding.speed", "model.generate per kind beside transformers' compiled static cache (--old-src)"),
    "profile": ("decoding.profile", "kernels per generated token of model.generate (top kernels by device time)"),
    "step-code": ("decoding.step_code", "what each kernel of a compiled decode step computes, from inductor's code"),
    "tuning": ("decoding.tuning", "batch-1 model.generate over fresh compiles: the one-row step's tuning default, "
                                  "timed by kernel time, or off"),
    "split-k": ("decoding.split_k", "the split-k-decode kernel alone: correctness against SDPA, the rate it reads"),
    "beam": ("decoding.beam", "beam search of the encoder-decoder, one source tree at a time (PYTHONPATH's)"),
    "rows": ("decoding.rows", "speed's worker for an older tree (PYTHONPATH=OLD/src)"),
}
OLDER_TREE = {"beam", "rows"}
"""Subcommands that import the tree on ``PYTHONPATH`` rather than this checkout's ``src``."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in SUBCOMMANDS and argv[0] not in OLDER_TREE:
        import toolbox  # noqa: F401  (this checkout's src first)
    return run_subcommand("decode.py", __doc__.split("\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
