"""``mhe generate`` on a trained language-model run, and its input handling."""

import json

import torch

from mhe.cli import main
from mhe.generation.session import left_pad


def test_left_pad_puts_every_prompt_at_the_right_edge():
    ids, mask = left_pad([[5, 6, 7], [8]], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_generate_command_continues_prompts(tmp_path, capsys):
    from conftest import require_data

    root = require_data("ptb/ptb.train.txt.gz")
    out = tmp_path / "lm"
    assert main(["train", "--task", "lm", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(root),
                 "--out", str(out), "--set", "train.steps=2", "--set", "data.limit_lines=300",
                 "--set", "train.eval_every=0", "--set", "model.n_layers=1"]) == 0
    capsys.readouterr()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the company said\nit is\n")
    assert main(["generate", "--checkpoint", str(out), "--input", str(prompts), "--prompt", "we",
                 "--max-new-tokens", "5", "--data-dir", str(root)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("we ") and lines[1].startswith("the company said ")
    assert main(["generate", "--checkpoint", str(out), "--prompt", "the", "--sample", "--seed", "1", "--top-k", "5",
                 "--max-new-tokens", "4", "--stream", "--data-dir", str(root)]) == 0
    first = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(out), "--prompt", "the", "--sample", "--seed", "1", "--top-k", "5",
                 "--max-new-tokens", "4", "--stream", "--data-dir", str(root)]) == 0
    assert capsys.readouterr().out == first  # reproducible under a seed
    assert main(["generate", "--checkpoint", str(out), "--data-dir", str(root)]) == 2  # no prompt: one-line error
    torch.manual_seed(0)


def test_generate_needs_only_the_run_folder(lm_run, tmp_path, monkeypatch, capsys):
    """A language-model run copied elsewhere generates with the data folder empty (the run holds
    its tokenizer; no corpus is read), and the continuation equals the one made beside the data."""
    import shutil

    args = ["--prompt", "the company said", "--max-new-tokens", "6"]
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(lm_run), *args]) == 0
    beside = capsys.readouterr().out
    moved = tmp_path / "elsewhere"
    shutil.copytree(lm_run, moved)
    empty = tmp_path / "no-data"
    empty.mkdir()
    monkeypatch.setenv("MHE_DATA", str(empty))
    record = json.loads((moved / "config.json").read_text())
    record["run"]["data"]["data_dir"] = str(empty)  # the data the run was trained on is gone
    (moved / "config.json").write_text(json.dumps(record))
    assert main(["generate", "--checkpoint", str(moved), *args]) == 0
    captured = capsys.readouterr()
    assert captured.out == beside and captured.out.startswith("the company said ")
    assert "not found" not in captured.err


def test_generate_says_why_each_prompt_stopped(lm_run, capsys):
    """One line per prompt on standard error; ``--min-new-tokens`` holds the end token back, so
    with it at ``--max-new-tokens`` every prompt runs to the length."""
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(lm_run), "--prompt", "the company said", "--prompt", "it",
                 "--max-new-tokens", "4", "--min-new-tokens", "4"]) == 0
    captured = capsys.readouterr()
    why = [line for line in captured.err.splitlines() if line.startswith("prompt ")]
    assert why == [f"prompt {i}: 4 new tokens, stopped by --max-new-tokens 4" for i in (1, 2)]
    assert len(captured.out.strip().splitlines()) == 2
    assert main(["generate", "--checkpoint", str(lm_run), "--prompt", "it", "--max-new-tokens", "1",
                 "--min-new-tokens", "1"]) == 0
    assert "prompt 1: 1 new token, stopped by --max-new-tokens 1\n" in capsys.readouterr().err  # one token, singular
    assert main(["generate", "--checkpoint", str(lm_run), "--prompt", "it", "--min-new-tokens", "-1"]) == 2
    assert "--min-new-tokens must be a non-negative integer, got -1" in capsys.readouterr().err


def test_generate_passes_its_step_options_to_the_session(lm_run, monkeypatch, capsys):
    """``--step-mode`` and ``--compile-options`` reach ``model.generate`` as the session's options
    (the compiled step's torch.compile options); without them the defaults (auto, None) do."""
    from mhe.models.decoder import DecoderForCausalLM

    seen = []
    original = DecoderForCausalLM.generate

    def spy(self, *args, **kw):
        seen.append((kw.get("step_mode"), kw.get("compile_options")))
        return original(self, *args, **kw)

    monkeypatch.setattr(DecoderForCausalLM, "generate", spy)
    base = ["generate", "--checkpoint", str(lm_run), "--prompt", "the", "--max-new-tokens", "2"]
    assert main(base) == 0
    assert main([*base, "--step-mode", "eager", "--compile-options", '{"mode": "default", "options": {}}']) == 0
    assert seen == [("auto", None), ("eager", {"mode": "default", "options": {}})]


def test_generate_refuses_bad_compile_options_in_one_line(lm_run, capsys):
    base = ["generate", "--checkpoint", str(lm_run), "--prompt", "the"]
    for text, words in (("{mode", "JSON object"), ("[1]", "JSON object"), ('{"fullgraph": false}', "'fullgraph'"),
                        ('{"options": 3}', "'options'")):
        assert main([*base, "--compile-options", text]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--compile-options" in err and words in err, err
