"""What every benchmark tool shares: where the repository and its ``src`` are, how a child
process finds the same ``src``, the one timer (:func:`mhe.bench.common.timed`), and how a tool
with subcommands runs one (:func:`run_subcommand`).

Each tool starts with ``from toolbox import ROOT`` (Python puts the tool's own folder first on
``sys.path``, so this module is always found). Importing it puts this checkout's ``src`` ahead of
any installed copy, so a tool run from a clone measures that clone's code, installed or not.
The parts of a tool with subcommands live in a folder beside it (``train/``, ``uptraining/``,
``records/``), imported as packages from this folder.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
BENCHMARKS = ROOT / "benchmarks"

for _folder in (BENCHMARKS, SRC):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child process (``python -m mhe ...``, ``torchrun``) that must import
    this checkout's ``src``, with ``extra`` variables set."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, **extra)


def timed(*args, **kwargs) -> float:
    """The toolbox's one timer: :func:`mhe.bench.common.timed` (CUDA events or wall clock,
    warm-ups, optional graph capture), imported late so that ``--help`` loads no torch."""
    from mhe.bench.common import timed as _timed

    return _timed(*args, **kwargs)


from subcommands import run_subcommand  # noqa: E402,F401  (the tools' dispatcher, re-exported)
