"""``mhe convert`` of Llama-style models end to end: a run folder (grouped K/V, Q/K/V biases,
partial rotary) converted to every kind is a run folder that ``mhe eval``, ``generate`` and
``pretrain --init-from`` take, whose configuration names the rope order it was fitted for; Hugging
Face Llama, Qwen2 and Mistral directories (tiny, random, built offline) convert with their
tokenizer; bad ``--set`` items are one line and exit 2."""

import json

import pytest
import torch

from conftest import require_data
from mhe.cli import main
from test_convert_cli import TINY

LLAMA = [*TINY, "--set", "model.qkv_bias=true", "--set", "model.rope_fraction=0.5"]


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A 4-step Llama-style GQA language model (4 heads of 8, 2 K/V heads) on 200 lines of PTB."""
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    out = tmp_path_factory.mktemp("runs") / "llama"
    assert main(["pretrain", "--preset", "llama-tiny", "--attention", "gqa", "--data", "ptb", "--data-dir", str(root),
                 "--out", str(out), *LLAMA]) == 0
    return out


def convert(source, out, kind, *extra):
    return main(["convert", "--checkpoint", str(source), "--attention", kind, "--out", str(out), "--device", "cpu",
                 "--calibration", "8", *extra])


@pytest.fixture(scope="module")
def llama_mul(llama_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("conv") / "mhe-mul"
    assert convert(llama_run, out, "mhe-mul") == 0
    return out


def test_the_converted_llama_folder_says_its_rope_order(llama_mul, llama_run):
    record = json.loads((llama_mul / "config.json").read_text())
    model = record["model"]
    assert model["attention"] == "mhe-mul" and model["positions"] == "rotary" and model["rope_fraction"] == 0.5
    assert model["attn_options"]["rope_order"] == "rope-then-psi" and model["qkv_bias"] is True
    assert record["run"]["model"]["attn_options"]["rope_order"] == "rope-then-psi"
    assert record["converted_from"]["attention"] == "gqa"
    report = json.loads((llama_mul / "conversion.json").read_text())
    assert report["options"]["attn_options"]["rope_order"] == "rope-then-psi" and report["options"]["cache_heads"] == 1
    assert "shared within each rotary pair" in report["options"]["rotary"]


def test_eval_generate_and_init_from_take_the_converted_llama(llama_mul, tmp_path, capsys):
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(llama_mul), "--split", "valid"]) == 0
    res = json.loads(capsys.readouterr().out)
    reported = json.loads((llama_mul / "conversion.json").read_text())["scores"]["converted"]
    assert res["perplexity"] == pytest.approx(reported["perplexity"], rel=1e-9)
    assert main(["generate", "--checkpoint", str(llama_mul), "--prompt", "the company", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the company")
    root = require_data("ptb/ptb.train.txt.gz")
    out = tmp_path / "uptrain"
    assert main(["pretrain", "--init-from", str(llama_mul), "--data", "ptb", "--data-dir", str(root), "--out", str(out),
                 "--set", "train.steps=2", "--set", "train.progress=false", "--set", "data.limit_lines=200",
                 "--set", "train.batch_size=4"]) == 0
    model = json.loads((out / "config.json").read_text())["model"]
    assert model["attention"] == "mhe-mul" and model["attn_options"]["rope_order"] == "rope-then-psi"
    assert model["positions"] == "rotary" and model["norm"] == "rmsnorm" and model["mlp"] == "swiglu"


@pytest.mark.parametrize("kind, extra", [("mhe-add", []), ("mqa", []), ("sha", []),
                                         ("gqa", ["--n-kv-heads", "2"]), ("gqa", ["--n-kv-heads", "4"])])
def test_every_target_converts_a_llama_run(llama_run, tmp_path, capsys, kind, extra):
    out = tmp_path / kind
    assert convert(llama_run, out, kind, *extra) == 0
    text = capsys.readouterr().out
    assert "rotary positions on 4 of 8 dimensions per head" in text and f"wrote {out}" in text
    assert ("rope_order=rope-then-psi" in text) == (kind == "mhe-add")
    scores = json.loads((out / "conversion.json").read_text())["scores"]
    if kind == "gqa":  # the source's own groups (2), or each K/V head copied for its query heads (4): no loss
        assert scores["converted"]["perplexity"] == pytest.approx(scores["source"]["perplexity"], rel=1e-6)


def test_psi_then_rope_is_fitted_when_asked_for(llama_run, tmp_path, capsys):
    out = tmp_path / "psi"
    assert convert(llama_run, out, "mhe-mul", "--no-eval", "--set", "model.attn_options.rope_order=psi-then-rope") == 0
    assert "rope_order=psi-then-rope: the head embeddings act before the rotation" in capsys.readouterr().out
    record = json.loads((out / "config.json").read_text())
    assert record["model"]["attn_options"]["rope_order"] == "psi-then-rope"
    assert json.loads((out / "conversion.json").read_text())["options"]["cache_heads"] == 4


@pytest.mark.parametrize("args, match", [
    (["--attention", "mhe-mul", "--set", "model.attn_options.rope_order=sideways"],
     "model.attn_options.rope_order"),
    (["--attention", "mqa", "--set", "model.attn_options.rope_order=psi-then-rope"],
     "unknown setting 'model.attn_options.rope_order'"),
    (["--attention", "mhe-mul", "--set", "model.rope_fraction=1.0"],
     "convert --set 'model.rope_fraction' is not allowed: a conversion keeps the source's model"),
    (["--attention", "gqa", "--n-kv-heads", "2", "--set", "model.attn_options.n_kv_heads=1"],
     "--n-kv-heads 2 and --set model.attn_options.n_kv_heads=1 disagree"),
    (["--attention", "mhe-add", "--set", "rope_order"], "--set takes KEY=VALUE, got 'rope_order'"),
])
def test_bad_set_items_are_one_line_and_exit_2(llama_run, tmp_path, capsys, args, match):
    assert main(["convert", "--checkpoint", str(llama_run), "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err
    assert not (tmp_path / "x").exists()


def _hf_dir(path, family, **opts):
    """A tiny random ``family`` causal LM with a byte-level BPE tokenizer, saved offline (the model's
    vocabulary padded beyond the tokenizer's, as released checkpoints' often are)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>")
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=tok.get_vocab_size() + 8, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, bos_token_id=1, eos_token_id=2, **opts)
    model = getattr(transformers, f"{family}ForCausalLM")(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights of order one: logits that tell models apart
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("family, kv, opts", [("Llama", 2, {"num_key_value_heads": 2}),
                                              ("Qwen2", 2, {"num_key_value_heads": 2}),
                                              ("Mistral", 1, {"num_key_value_heads": 1, "sliding_window": None})])
def test_a_hugging_face_llama_style_directory_converts(tmp_path, capsys, family, kv, opts):
    """Regrouped to its own K/V heads the converted folder computes the checkpoint's logits (the
    tokenizer's appended specials aside); converted to MHE-Mul it records the rope order."""
    from mhe.tasks.runs import load_run

    hf = _hf_dir(tmp_path / "hf", family, **opts)
    same = tmp_path / "same"
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "gqa", "--n-kv-heads", str(kv),
                 "--out", str(same), "--no-eval", "--calibration", "0"]) == 0
    assert "</s> is [EOS]" in capsys.readouterr().err
    model, cfg, _ = load_run(same, inference=True)
    # no preset (issue 58): the checkpoint's sizes are its own
    assert cfg.preset == "" and cfg.model.positions == "rotary" and cfg.model.qkv_bias == (family == "Qwen2")
    ids = torch.randint(3, hf.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids).logits[..., :hf.config.vocab_size], hf(ids).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-5
    out = tmp_path / "mul"
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "mhe-mul", "--out", str(out),
                 "--no-eval", "--calibration", "0"]) == 0
    assert json.loads((out / "config.json").read_text())["model"]["attn_options"]["rope_order"] == "rope-then-psi"
