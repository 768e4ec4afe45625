"""The ``mhe`` command answers at once (issue 45): its import graph, not a timing. ``mhe``,
``mhe --help`` and an unknown command import no torch; ``mhe params`` / ``mhe memory`` import
torch but not dynamo, inductor, the training engine, the data readers, transformers or
matplotlib (each seconds of start-up on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
HEAVY = ("torch", "torch._dynamo", "torch._inductor", "transformers", "matplotlib", "mhe.tasks", "mhe.training.loop",
         "mhe.data.corpora", "tokenizers")


def _imported(*argvs: list[str]) -> tuple[list[int], set[str]]:
    """(exit statuses, the HEAVY modules imported) of ``mhe ARGV`` for each ARGV, one after the
    other in one fresh interpreter."""
    code = ("import json, sys\nfrom mhe.cli import main\nrcs = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        rcs.append(main(argv))\n    except SystemExit as e:\n        rcs.append(e.code)\n"
            f"print(json.dumps([rcs, [m for m in {HEAVY!r} if m in sys.modules]]))")
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "MHE_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True, env=env,
                         timeout=120)
    rc, mods = json.loads(out.stdout.strip().splitlines()[-1])
    return rc, set(mods)


def test_help_and_command_errors_import_no_torch():
    assert _imported([], ["--help"], ["no-such-command"], ["--bogus"]) == ([0, 0, 2, 2], set())


def test_params_and_memory_import_torch_alone():
    rcs, mods = _imported(["params", "--preset", "llama-135m"], ["memory", "--preset", "bert-base"],
                          ["params", "--layers", "-1", "--heads", "2", "--head-dim", "4"])
    assert rcs == [0, 0, 2] and mods == {"torch"}


def test_the_constant_mark_is_dynamos_own():
    """``flash_decode.constant_result`` sets what ``torch.compiler.assume_constant_result`` sets."""
    import torch

    from mhe.attention.flash_decode import constant_result

    def ours():
        return 1

    def theirs():
        return 1

    torch.compiler.assume_constant_result(theirs)
    assert vars(constant_result(ours)) == vars(theirs) == {"_dynamo_marked_constant": True}
