"""Tokenizer kind and size from the preset (section 4.4), overridable with data.*."""

import json

import pytest

from mhe.models.config import PRESETS, preset
from mhe.tasks.text import tokenizer_for
from mhe.tasks.vocab import TokenizerChoice, preset_tokenizer, resolve_tokenizer
from mhe.training.config import DataConfig, RunConfig, apply_overrides


@pytest.mark.parametrize("name,task,want", [
    ("bert-base", "mlm", TokenizerChoice("wordpiece", 30_000)),
    ("bert-large", "mlm", TokenizerChoice("wordpiece", 30_000)),
    ("gpt2-base", "lm", TokenizerChoice("bpe", 50_257)),
    ("gpt2-medium", "lm", TokenizerChoice("bpe", 50_257)),
    ("transformer-base", "mt", TokenizerChoice("bpe", 37_000)),
    ("transformer-big", "mt", TokenizerChoice("bpe", 37_000)),
    ("tiny-encoder", "mlm", TokenizerChoice("wordpiece", 8192)),
    ("tiny-decoder", "lm", TokenizerChoice("bpe", 8192)),
    ("tiny-encoder-decoder", "mt", TokenizerChoice("bpe", 8000)),
])
def test_tokenizer_from_preset(name, task, want):
    assert preset_tokenizer(name, task) == want


def test_every_full_size_preset_follows_its_architecture():
    for name in PRESETS:
        if name.startswith("tiny-"):
            continue
        kind = {"encoder": "wordpiece", "decoder": "bpe", "encoder-decoder": "bpe"}[preset(name).arch]
        assert preset_tokenizer(name, "lm").kind == kind, name


def test_data_settings_override_the_convention():
    cfg = RunConfig(task="lm", preset="gpt2-base", data=DataConfig(dataset="wikitext-2"))
    assert resolve_tokenizer(cfg, "lm") == TokenizerChoice("bpe", 50_257)
    apply_overrides(cfg, ["data.vocab_size=16384"])
    assert resolve_tokenizer(cfg, "lm") == TokenizerChoice("bpe", 16_384)
    apply_overrides(cfg, ["data.tokenizer=wordpiece"])
    assert resolve_tokenizer(cfg, "lm") == TokenizerChoice("wordpiece", 16_384)
    ptb = RunConfig(task="lm", preset="gpt2-base", data=DataConfig(dataset="ptb"))
    assert resolve_tokenizer(ptb, "lm", word_level_corpus=True) == TokenizerChoice("word", 1_000_000)
    assert resolve_tokenizer(RunConfig(task="mt", preset="tiny-encoder-decoder",
                                       data=DataConfig(dataset="wmt14")), "mt").vocab_size == 37_000


def test_trained_tokenizer_has_the_preset_kind(tmp_path):
    lines = [f"the cat number {i} sat on mat {i % 7} and ran" for i in range(40)]
    cfg = RunConfig(task="mlm", preset="bert-base", data=DataConfig(dataset="wikitext-2"))
    tok = tokenizer_for(cfg, tmp_path / "enc", lines, task="mlm")
    assert json.loads(tok.to_str())["model"]["type"] == "WordPiece"
    cfg = RunConfig(task="lm", preset="gpt2-base", data=DataConfig(dataset="wikitext-2", vocab_size=300))
    tok = tokenizer_for(cfg, tmp_path / "dec", lines, task="lm")
    assert json.loads(tok.to_str())["model"]["type"] == "BPE"
    assert tok.get_vocab_size() == 300  # the override wins over GPT-2's 50,257
