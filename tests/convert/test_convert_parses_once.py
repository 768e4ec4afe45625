"""Issue 59: ``mhe convert --attention KIND`` parses KIND into its spec once, at the command's
start, and passes the spec down (options, checks, the model's fit, every sublayer's fit, the
rotary note, the written run), never the name to be looked up again."""

import json

import pytest
import torch

from mhe.cli import main
from mhe.convert import convert_model
from mhe.models import ModelConfig, build_model

transformers = pytest.importorskip("transformers")


def _llama_dir(path):
    """A tiny random Llama (2 layers, 4 heads, 2 K/V heads, rotary) saved without a tokenizer."""
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def test_mhe_convert_looks_the_target_kind_up_once(tmp_path, kind_lookups, capsys):
    _llama_dir(tmp_path / "hf")
    out = tmp_path / "conv"
    kind_lookups.clear()
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "mhe-mul", "--out", str(out),
                 "--device", "cpu", "--set", "model.attn_options.rope_order=psi-then-rope"]) == 0
    assert kind_lookups["mhe-mul"] == 1  # cmd_convert's parse of --attention; before issue 59's fix, 73
    report = json.loads((out / "conversion.json").read_text())
    assert report["kind"] == "mhe-mul" and report["source"] == "gqa"  # conversion.json names it as before
    assert report["options"]["attn_options"]["rope_order"] == "psi-then-rope"
    assert json.loads((out / "config.json").read_text())["model"]["attention"] == "mhe-mul"


def test_convert_model_parses_a_name_once_and_a_spec_never(kind_lookups):
    cfg = ModelConfig(arch="decoder", vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_len=16,
                      positions="rotary", norm="rmsnorm", mlp="swiglu", dropout=0.0, attn_dropout=0.0)
    model = build_model(cfg).eval()
    calibration = [torch.randint(0, 50, (2, 16))]
    kind_lookups.clear()
    by_name, report = convert_model(model, "mhe-add", calibration=calibration)
    assert kind_lookups["mhe-add"] == 1
    spec = by_name.cfg.spec
    kind_lookups.clear()
    by_spec, again = convert_model(model, spec, calibration=calibration)
    assert kind_lookups["mhe-add"] == 0 and again.kind == report.kind == "mhe-add"
    for (name, a), (_, b) in zip(by_name.state_dict().items(), by_spec.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
