"""``mhe generate`` on a trained language-model run, and its input handling."""

import torch

from mhe.cli import main
from mhe.generate_cli import left_pad


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
