"""Default output folders name the task, data, preset and kind (issue 19), so the documented
commands (docs/commands.md) run one after the other; a folder holding another run gets an error naming a free one."""

import argparse

import pytest

from conftest import require_data
from mhe.cli import main
from mhe.cli.compare import build_sweep
from mhe.experiments.sweep import default_compare_dir
from mhe.output_paths import default_run_dir, free_name

TINY = ["--set", "train.steps=2", "--set", "train.eval_every=0", "--set", "train.progress=false",
        "--set", "data.limit_lines=50", "--set", "train.batch_size=2", "--set", "model.n_layers=1",
        "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.max_len=16"]


def test_default_run_dir_names_every_part_and_drops_empty_ones():
    assert default_run_dir("lm", "ptb", "tiny-decoder", "mha").as_posix() == "runs/lm-ptb-tiny-decoder-mha"
    assert default_run_dir("recall", "", "tiny-decoder", "mqa").as_posix() == "runs/recall-tiny-decoder-mqa"


def test_free_name_skips_taken_folders(tmp_path):
    run = tmp_path / "lm-ptb"
    assert free_name(run) == run
    run.mkdir()
    assert free_name(run) == tmp_path / "lm-ptb-2"
    (tmp_path / "lm-ptb-2").mkdir()
    assert free_name(run) == tmp_path / "lm-ptb-3"


def _compare_args(**kw):
    base = dict(task=None, preset=None, kinds=None, seeds=None, data=None, data_dir="", set=[], workers=None,
                paper=None, pretrained="", out=None)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, expected", [
    ({}, "runs/compare-cpu-recall"),
    ({"preset": "cpu-ptb"}, "runs/compare-cpu-ptb"),
    ({"preset": "cpu-ptb", "data": "wikitext-2"}, "runs/compare-cpu-ptb-wikitext-2"),
    ({"preset": "tiny-decoder", "task": "lm", "data": "ptb"}, "runs/compare-tiny-decoder-lm-ptb"),
    ({"preset": "tiny-decoder", "task": "lm", "data": "wikitext-2"}, "runs/compare-tiny-decoder-lm-wikitext-2"),
])
def test_compare_default_folder_names_task_and_data(kw, expected):
    name, sweep = build_sweep(_compare_args(**kw))
    assert default_compare_dir(name, sweep).as_posix() == expected


def test_readme_pretrain_commands_run_in_sequence(tmp_path, monkeypatch, capsys):
    """PTB then WikiText-2 with no --out write two folders; a third, different run in the PTB
    folder is refused with one line that names the free folder."""
    root = require_data("ptb/ptb.train.txt.gz", "wikitext-2/wiki.train.tokens.xz")
    monkeypatch.chdir(tmp_path)
    for data in ("ptb", "wikitext-2"):
        assert main(["pretrain", "--preset", "tiny-decoder", "--data", data, "--data-dir", str(root), *TINY]) == 0
    assert (tmp_path / "runs/lm-ptb-tiny-decoder-mha/results.json").is_file()
    assert (tmp_path / "runs/lm-wikitext-2-tiny-decoder-mha/results.json").is_file()
    capsys.readouterr()
    assert main(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(root), *TINY,
                 "--set", "train.lr=2e-3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(train.lr: 0.001 there, 0.002 now)" in err[0]
    assert "runs/lm-ptb-tiny-decoder-mha-2 is free" in err[0]
