"""One rerun rule for every command that writes a run folder (pretrain, train-mt, compare; finetune
in test_finetune.py): a finished run of the same configuration is reported and its result
printed; another configuration is refused in one line naming the differences and a free folder;
an unfinished run continues only with --resume. And every setting, path and data source is
checked before a folder is created: a mistake leaves nothing behind."""

import json

import pytest

from conftest import require_data
from mhe.cli import main
from tiny_runs import COMMON

TINY_LM = ["--set", "train.steps=2", "--set", "train.progress=false", "--set", "data.limit_lines=50",
           "--set", "train.batch_size=2", "--set", "model.n_layers=1", "--set", "model.d_model=32",
           "--set", "model.d_ff=64", "--set", "model.max_len=16", "--set", "train.save_every=1"]
RECALL = ["--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.n_layers=1",
          "--set", "train.batch_size=16", "--set", "train.steps=4", "--set", "train.save_every=2",
          "--set", 'data.task_options={"train_size": 64, "test_size": 16, "pairs": 4, "queries": 4}']


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def test_pretrain_follows_the_rule(tmp_path, capsys):
    root = require_data("ptb/ptb.train.txt.gz")
    out = tmp_path / "lm"
    args = ["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(root), "--out", str(out)]
    assert main(args + TINY_LM + ["--set", "train.stop_at=1"]) == 0  # stopped at step 1 of 2: unfinished
    capsys.readouterr()
    assert main(args + TINY_LM) == 2
    assert "holds an unfinished run of this configuration (its newest checkpoint is step-00000001); pass --resume" \
        in one_line(capsys.readouterr().err)
    assert main(args + TINY_LM + ["--resume"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["status"] == "finished" and first["step"] == 2
    assert (first["split"], first["perplexity_per"]) == ("test", "word")  # PTB: the test split, per word
    stamp = (out / "results.json").stat().st_mtime_ns
    for extra in ([], ["--resume"]):  # finished: reported, its result printed, nothing trained
        assert main(args + TINY_LM + extra) == 0
        again = capsys.readouterr()
        assert json.loads(again.out) == first and f"already finished: results in {out}" in again.err
    assert main(args + TINY_LM + ["--set", "train.steps=3"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "(train.steps: 2 there, 3 now)" in err and f"{out}-2 is free" in err
    assert (out / "results.json").stat().st_mtime_ns == stamp


def test_train_mt_follows_the_rule(mt_run, tmp_path, capsys):
    root = require_data("multi30k/train.en.gz")
    args = ["train-mt", "--preset", "tiny-encoder-decoder", "--attention", "mhe-mul", "--data-dir", str(root),
            "--out", str(mt_run), *COMMON, "--set", "data.limit_lines=300", "--set", "data.vocab_size=300",
            "--set", "model.max_len=24",
            "--set", 'data.task_options={"test_sentences": 10, "eval_sentences": 10, "beam": 2}']
    saved = json.loads((mt_run / "results.json").read_text())
    capsys.readouterr()
    assert main(args) == 0
    again = capsys.readouterr()
    assert json.loads(again.out)["bleu"] == saved["bleu"] and f"already finished: results in {mt_run}" in again.err
    assert main(args + ["--set", "data.task_options.beam=3"]) == 2
    assert "(data.task_options.beam: 2 there, 3 now)" in one_line(capsys.readouterr().err)


def test_compare_follows_the_rule(tmp_path, capsys):
    out = tmp_path / "cmp"
    args = ["compare", "--preset", "tiny-decoder", "--kinds", "sha,mha", "--seeds", "1", "--workers", "1",
            "--out", str(out), *RECALL]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert main(args) == 0
    again = capsys.readouterr()
    assert again.out == table and f"already finished: results in {out}" in again.err
    assert "[start]" not in again.err
    assert main(args + ["--set", "train.lr=0.01"]) == 2
    err = one_line(capsys.readouterr().err)
    assert "holds a different comparison (train.lr: 0.003 there, 0.01 now)" in err and f"{out}-2 is free" in err


@pytest.mark.parametrize("name, argv, message", [
    ("typo-in-data", ["pretrain", "--preset", "tiny-decoder", "--data", "wikitext2"],
     "unknown dataset 'wikitext2'; valid: ptb, wikitext-2, wikitext-103, offline-english"),
    ("missing-data-folder", ["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", "{tmp}/none",
                             "--out", "{tmp}/out"], "data file not found: {tmp}/none/ptb/ptb.train.txt"),
    ("mt-missing-data-folder", ["train-mt", "--preset", "tiny-encoder-decoder", "--data-dir", "{tmp}/none"],
     "data file not found: {tmp}/none/multi30k/train.en"),
    ("mt-unknown-language", ["train-mt", "--preset", "tiny-encoder-decoder", "--src", "fr"],
     "unknown language of multi30k 'fr'"),
    ("lm-on-an-encoder", ["train", "--task", "lm", "--preset", "tiny-encoder", "--data", "ptb"],
     "causal language modelling needs a decoder preset"),
    ("init-from-missing", ["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--init-from", "{tmp}/none"],
     "--init-from {tmp}/none does not exist"),
    ("compare-typo-in-data", ["compare", "--preset", "tiny-decoder", "--task", "lm", "--data", "wikitext2"],
     "unknown dataset 'wikitext2'"),
])
def test_a_mistake_leaves_no_folder_behind(name, argv, message, tmp_path, monkeypatch, capsys):
    """Each mistake is one line and exit 2 before anything is created: no runs/ folder, no --out."""
    require_data("ptb/ptb.train.txt.gz", "multi30k/train.en.gz")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv + ["--set", "train.progress=false"]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in one_line(capsys.readouterr().err)
    assert list((tmp_path / "work").iterdir()) == [] and not (tmp_path / "out").exists()
