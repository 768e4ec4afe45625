"""Decoding on real hardware, one entry point: ``python benchmarks/decode.py COMMAND [ARGS]``.

Each command is a module of ``benchmarks/decoding/`` with its own flags
(``python benchmarks/decode.py COMMAND --help``):

    floor     one decode step of the Llama presets against the bytes it must read; the prefill's
              share of peak; the largest batch at a context (``--sections server``)
    census    the kernels of one compiled decode step, per layer and per kind (with the floor's rows)
    prefill   a long prompt's prefill alone: its share of the card's peak bf16 throughput
    anchor    FlashInfer's batch decode kernel beside mhe's on the same caches (an outside anchor)
    speed     ``model.generate`` per kind beside transformers' compiled static cache (``--old-src``)
    profile   kernels per generated token of ``model.generate`` (top kernels by device time)
    split-k   the ``split-k-decode`` kernel alone: correctness against SDPA, the rate it reads
    beam      beam search of the encoder-decoder, one source tree at a time
    rows      ``speed``'s worker for an older tree (``PYTHONPATH=OLD/src``; imports nothing else)

Every command but ``rows`` and ``beam`` measures this checkout's ``src`` (found through
``toolbox``); those two measure the tree on ``PYTHONPATH``, so an older tree can run them.
"""

from __future__ import annotations

import importlib
import sys

#: command -> (module of ``decoding``, whether it measures this checkout's ``src``)
COMMANDS = {"floor": ("floor", True), "census": ("census", True), "prefill": ("prefill", True),
            "anchor": ("anchor", True), "speed": ("speed", True), "profile": ("profile", True),
            "split-k": ("split_k", True), "beam": ("beam", False), "rows": ("rows", False)}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: decode.py {{{','.join(COMMANDS)}}} [ARGS]\n\n{__doc__}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"decode.py: unknown command {argv[0]!r}; the commands: {', '.join(COMMANDS)}", file=sys.stderr)
            raise SystemExit(2)
        raise SystemExit(0)
    module, this_tree = COMMANDS[argv[0]]
    if this_tree:
        import toolbox  # noqa: F401  (this checkout's src first)
    importlib.import_module(f"decoding.{module}").main(argv[1:])


if __name__ == "__main__":
    main()
