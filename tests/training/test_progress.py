"""Progress on standard error for the long phases (issue 19): with ``train.progress`` on, each
phase writes a tqdm bar (or, for tokenizer training, a line) to stderr; with it off, nothing.
The figures are the same either way."""

import pytest
import torch

from conftest import require_data
from mhe.tasks.runs import load_run
from mhe.cli import main
from mhe.data.tokenize import train_tokenizer
from mhe.metrics.perplexity import sliding_window_nll
from mhe.models import build_model
from mhe.tasks.text import token_stream

LINES = [f"the cat {i} sat on the mat and the dog {i % 7} ran" for i in range(60)]


@torch.no_grad()
def test_perplexity_windows_show_a_bar_only_when_asked(capsys):
    torch.manual_seed(0)
    model = build_model("tiny-decoder", n_layers=1, d_model=32, n_heads=4, d_ff=64, max_len=16,
                        vocab_size=99).eval()
    ids = torch.randint(0, 99, (200,))
    capsys.readouterr()
    quiet = sliding_window_nll(model, ids, max_len=16, stride=4, batch_size=8)
    assert capsys.readouterr().err == ""
    shown = sliding_window_nll(model, ids, max_len=16, stride=4, batch_size=8, progress=True)
    err = capsys.readouterr().err
    assert "perplexity (stride 4)" in err and "window" in err
    assert shown == quiet  # the bar changes nothing in the arithmetic

def test_tokenizer_training_and_tokenizing_report_progress(capsys):
    tok = train_tokenizer("bpe", LINES, 300, progress=False)
    quiet = token_stream(tok, LINES)
    assert capsys.readouterr().err == ""
    train_tokenizer("bpe", LINES, 300, progress=True)
    assert "training a bpe tokenizer of at most 300 entries on 60 lines" in capsys.readouterr().err
    shown = token_stream(tok, LINES, progress=True, desc="tokenizing the training text")
    err = capsys.readouterr().err
    assert "tokenizing the training text" in err and "line" in err
    assert torch.equal(shown, quiet)


@pytest.mark.parametrize("kind", ["bpe", "wordpiece", "word"])
def test_tokenizer_training_writes_nothing_on_standard_output(kind, capfd):
    """A command's result is the first thing on standard output, even when it trains a tokenizer
    with progress on (the tokenizers library's own bar would write blank lines there)."""
    train_tokenizer(kind, LINES, 300, progress=True)
    out, err = capfd.readouterr()
    assert out == "" and f"training a {kind} tokenizer" in err


def test_translation_decoding_shows_a_bar_only_when_asked(mt_run, capsys):
    model, _, task = load_run(mt_run, inference=True)
    sources = ["A dog runs.", "Two men play.", "A girl in a red coat."]
    capsys.readouterr()
    quiet = task.translate(model, sources, beam=2)
    assert capsys.readouterr().err == ""
    shown = task.translate(model, sources, beam=2, progress=True)
    err = capsys.readouterr().err
    assert "decoding (beam 2)" in err and "sentence" in err
    assert shown == quiet

@pytest.mark.parametrize("progress", [True, False])
def test_final_evaluation_of_a_run_reports_progress(progress, tmp_path, capsys):
    """A language-model run: data preparation, tokenizer training, the training bar, the final
    evaluation's line and its sliding-window bar all on stderr, or nothing at all."""
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    capsys.readouterr()
    assert main(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(root),
                 "--out", str(tmp_path / "lm"), "--set", f"train.progress={str(progress).lower()}",
                 "--set", "train.steps=2", "--set", "train.eval_every=1", "--set", "data.limit_lines=50",
                 "--set", "data.tokenizer=bpe", "--set", "data.vocab_size=300", "--set", "model.n_layers=1",
                 "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.max_len=16",
                 "--set", "train.batch_size=2"]) == 0
    err = capsys.readouterr().err
    phases = ("training a bpe tokenizer", "tokenizing the training text", "final evaluation (lm) of the best weights",
              "perplexity (stride 8)")
    if progress:
        assert all(p in err for p in phases), err
    else:
        assert err == ""


def test_only_the_main_process_draws(monkeypatch, capsys):
    from mhe.progress import bar, note

    monkeypatch.setenv("RANK", "1")
    with bar(3, desc="phase", unit="it", enabled=True) as shown:
        shown.update(3)
    note("a line", enabled=True)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with bar(3, desc="phase", unit="it", enabled=True) as shown:
        shown.update(3)
    note("a line", enabled=True)
    err = capsys.readouterr().err
    assert "phase" in err and "a line" in err
