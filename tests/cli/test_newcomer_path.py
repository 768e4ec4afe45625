"""The first hour of a new user (issue 58), walked end to end on a tiny random Llama saved with
``save_pretrained`` and no tokenizer: convert -> uptrain -> eval -> generate -> export -> load with
transformers alone. Every step either refuses in one line with exit 2 (text given to a run whose
tokenizer holds ids only; an uptraining of unstated length) or scores real text: the encoded corpus
uses more than 100 distinct ids. The exported model card's loading snippet runs as written with
standard input closed, in a Python where mhe cannot be imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import require_data
from mhe.cli import main

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # two conversions, one short uptraining and two Pythons with transformers (~40 s)

VOCAB = 1024
CHEAP = ["--set", "train.progress=false", "--set", "data.limit_lines=200", "--set", "train.batch_size=4"]

# the card's snippet, run as written in the exported folder (mhe unimportable), then its logits saved
LOADER = """
import sys
sys.modules["mhe"] = None
import torch
torch.set_num_threads(1)
{snippet}
with torch.no_grad():
    torch.save(model(torch.tensor([{ids}])).logits, "logits.pt")
"""


def _llama(path):
    """A tiny random Llama (2 layers of 32, 4 heads, 2 K/V heads) saved without a tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def _tokenizer_folder(path, lines):
    """A byte-level BPE of 1,000 entries as transformers saves one (``<unk>``, ``<s>``, ``</s>`` first)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>", "<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                       show_progress=False))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(path)


def _refused(argv, capsys, *needles) -> str:
    assert main(argv) == 2, argv
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert all(n in err for n in needles), err
    return err


def _card_logits(folder, ids) -> torch.Tensor:
    """The exported card's loading snippet, run as written from ``folder`` with standard input
    closed and mhe unimportable; the logits of ``ids`` from the model it loads."""
    card = (folder / "README.md").read_text()
    snippet = re.search(r"```python\n(.*?)```", card, re.S).group(1)
    env = {**os.environ, "HF_MODULES_CACHE": str(folder / ".modules"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", LOADER.format(snippet=snippet, ids=ids)], cwd=folder, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[y/N]" not in done.stdout + done.stderr  # transformers asked nothing (it would wait on a terminal)
    return torch.load(folder / "logits.pt")


def _same_logits(run, folder, ids):
    from mhe.tasks.runs import load_run

    model = load_run(run, inference=True)[0]
    with torch.no_grad():
        ours = model(torch.tensor([ids])).logits
    theirs = _card_logits(folder, ids)
    assert float((ours - theirs).abs().max() / ours.abs().max()) < 1e-5


def test_an_ids_only_conversion_is_refused_wherever_text_goes_in(tmp_path, capsys):
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    data = ["--data-dir", str(root)]
    hf, conv = tmp_path / "llama-hf", tmp_path / "llama-mhe-mul"
    _llama(hf)
    assert main(["convert", "--checkpoint", str(hf), "--attention", "mhe-mul", "--out", str(conv)]) == 0
    capsys.readouterr()
    fix = f"mhe convert --checkpoint {hf} --tokenizer FOLDER"
    _refused(["pretrain", "--init-from", str(conv), "--data", "ptb", *data, "--set", "train.steps=2",
              "--out", str(tmp_path / "up")], capsys, "holds ids only", fix)
    _refused(["eval", "--run", str(conv), "--data", "ptb", *data], capsys, "holds ids only", fix)
    _refused(["eval", "--run", str(conv), *data], capsys, "holds ids only")
    _refused(["generate", "--run", str(conv), "--prompt", "the company said"], capsys, "holds ids only", fix)
    _refused(["finetune", "--task", "rte", "--run", str(conv), *data], capsys, "holds ids only")
    _refused(["compare", "--task", "lm", "--preset", "tiny-decoder", "--kinds", "mha", "--seeds", "1", "--data", "ptb",
              *data, "--set", f"train.init_from={conv}", "--out", str(tmp_path / "cmp")], capsys, "holds ids only", fix)
    assert not (tmp_path / "up").exists() and not (tmp_path / "cmp").exists()
    # an export works on ids, and its card says so
    out = tmp_path / "exported-ids"
    assert main(["export", "--run", str(conv), "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    assert f"| tokenizer | ids only, {VOCAB:,} entries |" in card and "**This tokenizer holds ids only**" in card
    _same_logits(conv, out, [1, 17, 42, 99, 250])


def test_a_conversion_with_the_sources_tokenizer_trains_and_scores_real_text(tmp_path, capsys):
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    from mhe.data.corpora import read_lines
    from mhe.data.tokenize import load_tokenizer
    from mhe.tasks.text import token_stream

    data = ["--data-dir", str(root)]
    hf, tok_dir, conv, up = (tmp_path / n for n in ("llama-hf", "tok", "llama-mhe-mul", "up"))
    _llama(hf)
    _tokenizer_folder(tok_dir, read_lines("ptb", "train", data_dir=str(root), limit=2000))
    assert main(["convert", "--checkpoint", str(hf), "--tokenizer", str(tok_dir), "--attention", "mhe-mul",
                 "--out", str(conv)]) == 0
    capsys.readouterr()
    # uptraining needs its length: the default schedule is a pre-training's; the model is the source's
    _refused(["pretrain", "--init-from", str(conv), "--data", "ptb", *data, "--out", str(up), *CHEAP], capsys,
             "is a conversion", "--set train.steps=N")
    _refused(["pretrain", "--init-from", str(conv), "--preset", "llama-135m", "--data", "ptb", *data, "--out", str(up),
              *CHEAP, "--set", "train.steps=2"], capsys,
             "--preset llama-135m (the source's: none, its sizes are its own)")
    assert main(["pretrain", "--init-from", str(conv), "--data", "ptb", *data, "--out", str(up), *CHEAP,
                 "--set", "train.steps=2"]) == 0
    capsys.readouterr()
    valid = read_lines("ptb", "valid", data_dir=str(root), limit=200)  # what eval scores (data.limit_lines)
    stream = token_stream(load_tokenizer(up), valid)
    assert len(set(stream.tolist())) > 100  # real text, not [PAD]s
    assert main(["eval", "--run", str(up), "--data", "ptb", *data, "--split", "valid"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["perplexity_per"] == "token" and res["tokenizer"] == f"BPE, {VOCAB:,} entries"
    assert 1 < res["perplexity"] < 2 * VOCAB and res["tokens"] == stream.numel() - 1
    assert main(["generate", "--run", str(up), "--prompt", "the company said", "--max-new-tokens", "4"]) == 0
    assert capsys.readouterr().out.startswith("the company said")
    out = tmp_path / "exported"
    assert main(["export", "--run", str(up), "--out", str(out)]) == 0
    card = (out / "README.md").read_text()
    results = json.loads((up / "results.json").read_text())
    assert f"| perplexity (per token) | {results['perplexity']:.6g} |" in card
    assert f"measured with the run's tokenizer (BPE, {VOCAB:,} entries)" in card and "ids only" not in card
    # the conversion and its uptraining record the checkpoint's own sizes, under no preset's name
    for run in (conv, up):
        saved = json.loads((run / "config.json").read_text())
        assert saved["run"]["preset"] == "" and saved["run"]["model"]["n_layers"] == 2
        assert saved["model"]["d_model"] == 32 and saved["model"]["n_heads"] == 4
    assert json.loads((up / "results.json").read_text())["preset"] == ""
    assert "llama-135m" not in card
    _same_logits(up, out, load_tokenizer(up).encode("the company said").ids)
