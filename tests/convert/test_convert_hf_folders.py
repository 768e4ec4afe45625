"""``mhe convert`` of a Hugging Face ``LlamaForCausalLM`` folder as ``save_pretrained`` writes it
(issue 45): without a tokenizer (ids only, not scored without a corpus), with its own tokenizer or
one passed with ``--tokenizer`` (a decoder keeps its special tokens and vocabulary size); and
broken folders (issue 46): a truncated or missing ``model.safetensors``, or tensors of other shapes
than ``config.json``, are one line and exit 2 (``MheError`` from ``import_hf``), no folder written."""

import json
import re

import pytest
import torch

from mhe.cli import main
from mhe.errors import MheError
from test_convert_llama_cli import _hf_dir

transformers = pytest.importorskip("transformers")


def _llama(path, vocab=64):
    """A tiny random Llama (2 layers, 4 heads, 2 K/V heads) saved without a tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def _convert(src, out, *extra):
    return main(["convert", "--checkpoint", str(src), "--attention", "mhe-mul", "--out", str(out), "--device", "cpu",
                 *extra])


def test_a_folder_without_a_tokenizer_converts_on_ids_and_says_it_did_not_score(tmp_path, capsys):
    hf = _llama(tmp_path / "hf")
    out = tmp_path / "conv"
    assert _convert(tmp_path / "hf", out) == 0
    cap = capsys.readouterr()
    assert "not scored: no corpus given (--data)" in cap.out and f"wrote {out}" in cap.out
    assert "tokenizer: none in" in cap.err and "vocabulary of 64 ([BOS] = 1, [EOS] = 2)" in cap.err
    assert "calibration: none without a corpus" in cap.err
    from mhe.tasks.runs import load_run
    model, cfg, task = load_run(out, inference=True)
    assert cfg.model.vocab_size == 64 == task.tok.get_vocab_size() and cfg.model.attention == "mhe-mul"
    assert task.tok.token_to_id("[EOS]") == 2 and task.tok.token_to_id("[CLS]") is None
    assert "not_scored" in json.loads((out / "conversion.json").read_text())["options"]
    # regrouped to its own two K/V heads, the ids-only run computes the checkpoint's logits
    same = tmp_path / "same"
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "gqa", "--n-kv-heads", "2",
                 "--out", str(same), "--no-align"]) == 0
    model, _, _ = load_run(same, inference=True)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf(ids).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-5


def test_data_without_a_tokenizer_is_one_line(tmp_path, capsys):
    _llama(tmp_path / "hf")
    capsys.readouterr()
    assert _convert(tmp_path / "hf", tmp_path / "conv", "--data", "ptb") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has no tokenizer: pass --tokenizer DIR" in err
    assert not (tmp_path / "conv").exists()


def test_a_decoder_keeps_its_own_special_tokens_and_vocabulary(tmp_path, capsys):
    """The folder's own tokenizer, or the same one passed as --tokenizer: no [CLS]/[SEP]/[MASK] added,
    the vocabulary stays the model's; </s> becomes [EOS]."""
    hf = _hf_dir(tmp_path / "own", "Llama", num_key_value_heads=2)
    _llama(tmp_path / "bare", vocab=hf.config.vocab_size)
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "tok" / name).write_bytes((tmp_path / "own" / name).read_bytes())
    from mhe.tasks.runs import load_run
    for src, extra in ((tmp_path / "own", []), (tmp_path / "bare", ["--tokenizer", str(tmp_path / "tok")])):
        out = tmp_path / f"conv-{src.name}"
        assert _convert(src, out, "--calibration", "0", *extra) == 0
        err = capsys.readouterr().err
        assert "</s> is [EOS]" in err and "added after the vocabulary" not in err
        _, cfg, task = load_run(out, inference=True)
        assert cfg.model.vocab_size == hf.config.vocab_size == task.tok.get_vocab_size()
        assert all(task.tok.token_to_id(s) is None for s in ("[CLS]", "[SEP]", "[MASK]"))
        assert task.tok.token_to_id("[EOS]") == 2


def _truncated(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _missing(path):
    (path / "model.safetensors").unlink()


def _other_shapes(path):
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 40
    (path / "config.json").write_text(json.dumps(cfg))


def _layers(n):
    def spoil(path):
        cfg = json.loads((path / "config.json").read_text())
        cfg["num_hidden_layers"] = n
        (path / "config.json").write_text(json.dumps(cfg))
    return spoil


def _pickle_only(path):
    from safetensors.torch import load_file
    torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()


@pytest.mark.parametrize("spoil, match", [
    (_layers(3), "config.json's model has weights the folder does not store (model.layers.2.self_attn.q_proj.weight, "
                 "model.layers.2.self_attn.k_proj.weight, model.layers.2.self_attn.v_proj.weight, "
                 "model.layers.2.self_attn.o_proj.weight, model.layers.2.mlp.gate_proj.weight and 4 more)"),
    (_layers(1), "the folder stores weights config.json's model does not have (model.layers.1."),
    (_pickle_only, "holds its weights only as pytorch_model.bin (a pickle, not opened"),
    (_truncated, "model.safetensors is truncated"),
    (_missing, "has no weights: none of model.safetensors"),
    (_other_shapes, "mlp.down_proj.weight has shape [32, 48], its config.json gives [32, 40]"),
])
def test_a_broken_folder_is_one_line_before_any_folder_is_written(tmp_path, capsys, spoil, match):
    _llama(tmp_path / "hf")
    spoil(tmp_path / "hf")
    capsys.readouterr()  # transformers' own lines while saving
    assert _convert(tmp_path / "hf", tmp_path / "conv") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err
    assert not (tmp_path / "conv").exists()
    from mhe.hf import import_hf
    with pytest.raises(MheError, match=re.escape(match)):
        import_hf(tmp_path / "hf")


def test_a_runs_tokenizer_and_a_corpus_score_the_folder(lm_run, tmp_path, capsys):
    """--tokenizer RUN takes the run's tokenizer (its vocabulary sized to the model's); with --data the
    source and the converted model are scored, the perplexity naming its unit."""
    from conftest import require_data
    from mhe.data.tokenize import load_tokenizer

    vocab = load_tokenizer(lm_run).get_vocab_size()
    _llama(tmp_path / "hf", vocab=vocab)
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz")
    out = tmp_path / "conv"
    assert _convert(tmp_path / "hf", out, "--tokenizer", str(lm_run), "--data", "ptb", "--data-dir", str(root),
                    "--set", "model.attn_options.rope_order=rope-then-psi", "--calibration", "4") == 0
    cap = capsys.readouterr()
    assert f"tokenizer: the run {lm_run}'s" in cap.err
    assert "perplexity per word on the valid split, before any training:" in cap.out
    scores = json.loads((out / "conversion.json").read_text())["scores"]
    assert scores["source"]["perplexity_per"] == "word" and scores["converted"]["perplexity"] > 1
