"""Continued pre-training (`mhe pretrain --init-from RUN`) and cross-corpus perplexity
(`mhe eval --data CORPUS`) on tiny synthetic corpora."""

import json
import math

import pytest
import torch

from mhe.tasks import run_config_from_dict
from mhe.cli import main
from mhe.errors import MheError

TINY = ["--set", "train.steps=2", "--set", "train.progress=false", "--set", "train.batch_size=4",
        "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.n_layers=1", "--set", "model.max_len=32",
        "--set", "data.vocab_size=120"]


@pytest.fixture
def corpora(tmp_path):
    """WikiText-2-shaped and PTB-shaped files with different text."""
    root = tmp_path / "data"
    (root / "wikitext-2").mkdir(parents=True)
    (root / "ptb").mkdir()
    for split, n in (("train", 60), ("valid", 10), ("test", 12)):
        wiki = [f" the river {i % 9} flows past the old mill and town {i % 5} ." for i in range(n)]
        ptb = [f" a market of {i % 7} shares rose in new york trading {i % 4}" for i in range(n)]
        (root / "wikitext-2" / f"wiki.{split}.tokens").write_text("\n".join(wiki) + "\n")
        (root / "ptb" / f"ptb.{split}.txt").write_text("\n".join(ptb) + "\n")
    return root


def _pretrain(root, out, data, *extra):
    assert main(["pretrain", "--preset", "tiny-decoder", "--attention", "mhe-mul", "--data", data,
                 "--data-dir", str(root), "--out", str(out), *TINY, *extra]) == 0


def test_init_from_starts_with_the_source_weights_and_tokenizer(corpora, tmp_path):
    from mhe.tasks.lm import CausalLMTask
    from mhe.training.weights import read_sealed_weights as model_weights
    from mhe.training.checkpoint import latest_checkpoint
    from mhe.training.config import RunConfig
    from mhe.training.distributed import Dist

    src = tmp_path / "a"
    _pretrain(corpora, src, "wikitext-2", "--set", "data.tokenizer=bpe")
    cont = tmp_path / "b"
    _pretrain(corpora, cont, "ptb", "--init-from", str(src), "--set", "data.tokenizer=bpe")
    assert (cont / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    cfg = run_config_from_dict(json.loads((cont / "config.json").read_text())["run"], source="test")
    assert cfg.train.init_from == str(src) and cfg.data.dataset == "ptb"
    # step 0 of the continued run (what the trainer builds before its first step) = the source's weights
    model = CausalLMTask().setup(cfg, tmp_path / "c", Dist())
    source = model_weights(latest_checkpoint(src / "checkpoints"))
    own = model.state_dict()
    assert set(source) <= set(own)
    assert all(torch.equal(own[k], v) for k, v in source.items())
    res = json.loads((cont / "results.json").read_text())
    assert res["steps"] == 2 and res["status"] == "finished"  # its own schedule, from step 0
    # after training, the continued run moved away from the source
    moved = model_weights(latest_checkpoint(cont / "checkpoints"))
    assert any(not torch.equal(moved[k], v) for k, v in source.items())


def test_init_from_refuses_another_shape(corpora, tmp_path):
    from mhe.tasks.lm import CausalLMTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.distributed import Dist

    src = tmp_path / "a"
    _pretrain(corpora, src, "wikitext-2")
    cfg = apply_overrides(default_run("lm", "tiny-decoder", "mhe-mul", "ptb"),
                          [s for s in TINY if s != "--set"] + ["model.d_model=64", f"train.init_from={src}"])
    cfg.data.data_dir = str(corpora)
    with pytest.raises(MheError, match="use the source's preset and model.. settings"):
        CausalLMTask().setup(cfg, tmp_path / "x", Dist())


def test_eval_on_another_corpus_uses_the_run_tokenizer(corpora, tmp_path, capsys):
    from mhe.tasks.runs import load_run
    from mhe.data.tokenize import load_tokenizer
    from mhe.metrics.perplexity import perplexity, sliding_window_nll

    run = tmp_path / "a"
    _pretrain(corpora, run, "wikitext-2", "--set", "data.tokenizer=bpe")  # sub-words: per token and per word
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), "--data", "ptb", "--data-dir", str(corpora)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["dataset"] == "ptb" and res["trained_on"] == "wikitext-2" and res["split"] == "test"
    assert res["stride"] == 16  # 256 capped at half the 32-token window
    # by hand: PTB's test lines through the run's own tokenizer, [EOS] after each line
    tok = load_tokenizer(run)
    lines = [line.strip() for line in (corpora / "ptb" / "ptb.test.txt").read_text().splitlines()]
    ids = []
    for line in lines:
        ids += tok.encode(line, add_special_tokens=False).ids + [tok.token_to_id("[EOS]")]
    model, _, _ = load_run(run, data_dir=str(corpora))
    nll, n = sliding_window_nll(model, torch.tensor(ids), max_len=32, stride=16, batch_size=16)
    assert res["tokens"] == n == len(ids) - 1
    assert res["perplexity"] == pytest.approx(perplexity(nll, n), rel=1e-12)
    words = sum(len(line.split()) + 1 for line in lines) - 1  # words plus one [EOS] a line, minus the first
    assert res["words"] == words
    assert res["word_perplexity"] == pytest.approx(math.exp(nll / words), rel=1e-12)
    # the same run on its own corpus gives another figure
    assert main(["eval", "--checkpoint", str(run), "--data-dir", str(corpora)]) == 0
    own = json.loads(capsys.readouterr().out)
    assert own["tokens"] != res["tokens"]
