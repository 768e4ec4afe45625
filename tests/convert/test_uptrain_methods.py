"""``benchmarks/uptrain.py methods`` (``benchmarks/uptraining/methods.py``, issue 61's study): its plan is ``mhe pretrain --init-from``
commands the parser takes, each method from its own converted folder, the ``-kd`` ones with the
distillation settings and the others without; unknown methods are refused; the CPU smoke run end
to end (pre-training, conversions with the output fit, uptraining with distillation) is a slow
test."""

import json
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from conftest import require_data
from mhe.cli import build_parser

BENCH = Path(__file__).resolve().parent.parent.parent / "benchmarks"


def methods():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from uptraining import methods as mod

    return mod


def test_the_plan_is_valid_commands_with_the_methods_settings(tmp_path, capsys):
    mod = methods()
    assert mod.main(["--out", str(tmp_path / "m"), "--data-dir", "data", "--dry-run"]) == 0
    parser = build_parser()
    cmds = [parser.parse_args(shlex.split(line)[1:]) for line in capsys.readouterr().out.splitlines()]
    assert len(cmds) == len(mod.DEFAULT_METHODS) * 2 * 3  # methods x fractions x seeds
    by_run = {Path(c.out).name: c for c in cmds}
    kd = by_run["uptrain-mhe-mul-outputs-kd-10pct-seed2"]
    assert kd.command == "pretrain" and kd.init_from.endswith("convert-mhe-mul-outputs") and kd.seed == 2
    assert "train.steps=120" in kd.set and "train.distill_weight=0.5" in kd.set
    assert f"train.distill_from={tmp_path / 'm' / 'runs' / 'pretrain-mha'}" in kd.set
    plain = by_run["uptrain-mhe-mul-psi-then-rope-5pct-seed0"]
    assert plain.init_from.endswith("convert-mhe-mul-psi-then-rope") and "train.steps=60" in plain.set
    assert not any("distill" in s for s in plain.set)
    assert by_run["uptrain-mhe-mul-kd-5pct-seed1"].init_from.endswith("convert-mhe-mul")


def test_an_unknown_method_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        methods().main(["--out", str(tmp_path / "m"), "--methods", "mhe-mul,best", "--dry-run"])
    assert e.value.code == 2 and "unknown method 'best'" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cpu_smoke_runs_every_stage(tmp_path):
    root = require_data("wikitext-2/wiki.train.tokens.xz", "wikitext-2/wiki.valid.tokens.gz",
                        "wikitext-2/wiki.test.tokens.gz", "ptb")
    out = tmp_path / "m"
    assert methods().main(["--cpu-smoke", "--data-dir", str(root), "--out", str(out),
                           "--methods", "mqa,mhe-mul-outputs-kd"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["method"]: r for r in summary["rows"]}
    assert rows["mqa"]["seeds_25pct"] == rows["mhe-mul-outputs-kd"]["seeds_25pct"] == 2
    fit = json.loads((out / "runs" / "convert-mhe-mul-outputs" / "conversion.json").read_text())["options"]
    assert all(r["output_fit"] <= r["weight_fit"] for r in fit["output_fit"]["layers"])
    train = json.loads((out / "runs" / "uptrain-mhe-mul-outputs-kd-25pct-seed0" / "config.json").read_text())
    assert train["run"]["train"]["distill_from"] == str(out / "runs" / "pretrain-mha")


@pytest.mark.slow
def test_a_folder_returned_without_weights_resumes_with_only_what_is_left(tmp_path):
    """The first call's folder as a device archive returns it (no weights): the same command
    pre-trains the source again (for the -kd runs and the missing conversion), converts again
    only what unfinished runs need and runs only those; with every run finished it loads nothing."""
    root = require_data("wikitext-2/wiki.train.tokens.xz", "wikitext-2/wiki.valid.tokens.gz",
                        "wikitext-2/wiki.test.tokens.gz", "ptb")
    out = tmp_path / "m"
    argv = ["--cpu-smoke", "--data-dir", str(root), "--out", str(out), "--methods", "mqa,mhe-mul-kd"]
    assert methods().main(argv) == 0
    runs = out / "runs"
    for folder in ("pretrain-mha", "convert-mqa", "convert-mhe-mul"):
        shutil.rmtree(runs / folder / "checkpoints")
    redo = runs / "uptrain-mhe-mul-kd-25pct-seed1"
    shutil.rmtree(redo)
    first = json.loads((out / "summary.json").read_text())
    assert methods().main(argv) == 0
    log = (out / "methods.log").read_text().split("uptraining methods on")[-1]
    assert "[redo] pretrain-mha" in log and "[redo] convert-mhe-mul" in log and "convert-mqa" not in log
    assert (runs / "pretrain-mha.no-weights" / "results.json").is_file() and (redo / "results.json").is_file()
    assert "[start] uptrain-mhe-mul-kd-25pct-seed1" in log and "[start] uptrain-mhe-mul-kd-25pct-seed0" not in log
    again = json.loads((out / "summary.json").read_text())
    assert again["source"]["ppl_source"] == pytest.approx(first["source"]["ppl_source"], rel=1e-4)  # seeded, CPU
    assert methods().main(argv) == 0
    assert "[source] not needed: every run finished" in (out / "methods.log").read_text()
