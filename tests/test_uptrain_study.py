"""``benchmarks/uptrain_study.py``: its plan is made of commands the ``mhe`` parser takes, with
the documented uptraining recipe; the CPU smoke run end to end is a slow test."""

import importlib.util
import json
import shlex
import sys
from pathlib import Path

import pytest

from conftest import require_data
from mhe.cli import build_parser

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "uptrain_study.py"


def study():
    spec = importlib.util.spec_from_file_location("uptrain_study", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["uptrain_study"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_plan_is_valid_mhe_commands(tmp_path, capsys):
    assert study().main(["--out", str(tmp_path / "s"), "--data-dir", "data", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 5 + 5 * 2 * 3  # pre-training, scratch, kinds x fractions x seeds
    parser = build_parser()
    for line in lines:
        args = parser.parse_args(shlex.split(line)[1:])
        assert args.command == "pretrain"
    pre, scratch, up = (parser.parse_args(shlex.split(lines[i])[1:]) for i in (0, 1, 6))
    assert pre.attention == "mha" and "train.steps=2000" in pre.set
    assert scratch.attention == "mqa" and "train.steps=2200" in scratch.set  # N + the longest uptraining
    assert up.init_from.endswith("convert-mqa") and up.attention is None and "train.steps=100" in up.set
    assert not any(s.startswith(("model.", "train.warmup")) for s in up.set)  # the recipe's own defaults


@pytest.mark.slow
def test_cpu_smoke_runs_end_to_end(tmp_path):
    root = require_data("wikitext-2/wiki.valid.tokens.gz", "ptb/ptb.train.txt.gz", "glue/RTE/train.tsv.gz")
    out = tmp_path / "smoke"
    assert study().main(["--cpu-smoke", "--data-dir", str(root), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    kinds = [r["kind"] for r in summary["rows"]]
    assert kinds == ["mha", "mqa", "gqa", "mhe-mul", "mhe-add", "sha"]
    for r in summary["rows"][1:]:
        assert r["ppl_converted"] > 1 and r["ppl_scratch"] > 1 and r["seeds_up_25pct"] == 1
    assert (out / "uptrain.png").stat().st_size > 0 and "Same total steps" in (out / "RUN.md").read_text()
