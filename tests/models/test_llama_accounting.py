"""Whole-model counts of decoder language models (``decoder_params``, ``decoder_memory``,
``mhe params`` / ``mhe memory``): equal to counting the built model, and to Hugging Face's own
count of the public models the llama-* presets are shaped like."""

import json

import pytest
import torch

from mhe.accounting.memory import decoder_memory
from mhe.accounting.params import decoder_params
from mhe.attention import KINDS, PAPER_KINDS
from mhe.cli import main
from mhe.models import build_model, preset

DECODERS = ["llama-tiny", "llama-135m", "llama-1.1b", "tiny-decoder", "gpt2-base"]


def held(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name", DECODERS)
def test_whole_model_count_equals_the_built_model(name):
    cfg = preset(name).replace(n_layers=2)  # the widths of the preset; two layers keep the test quick
    extras = ({}, {"qkv_bias": True}, {"tie_embeddings": not cfg.tie_embeddings})
    for i, kind in enumerate(KINDS):
        if kind == "fnet" or (kind == "linear" and cfg.positions == "rotary"):
            continue
        c = cfg.replace(attention=kind, **extras[i % 3])  # every kind, each with one variant in turn
        with torch.device("meta"):
            model = build_model(c)
        assert decoder_params(c)["total"] == held(model), (name, kind, extras[i % 3])


def test_presets_count_as_the_public_models():
    """SmolLM-135M and TinyLlama-1.1B's published totals; transformers' own count of the same shapes
    (two layers of each, built on the meta device) agrees."""
    transformers = pytest.importorskip("transformers")
    from mhe.hf.llama import llama_hf_config

    for name, published in (("llama-135m", 134_515_008), ("llama-1.1b", 1_100_048_384)):
        assert decoder_params(preset(name))["total"] == published
        cfg = preset(name).replace(n_layers=2)
        with torch.device("meta"):
            hf = transformers.LlamaForCausalLM(llama_hf_config(cfg, "LlamaForCausalLM"))
        assert decoder_params(cfg)["total"] == hf.num_parameters()


def test_kv_cache_per_token_follows_the_cached_heads():
    cfg = preset("llama-135m")  # 30 layers, 9 heads of 64, GQA with 3 K/V heads
    per_head = 2 * 30 * 64 * 2  # K and V, every layer, bf16
    heads = {"mha": 9, "gqa": 3, "mqa": 1, "mhe-mul": 1}
    for kind, n in heads.items():
        assert decoder_memory(cfg.replace(attention=kind))["kv_cache_bytes_per_token"] == n * per_head
    psi_first = cfg.replace(attention="mhe-mul", attn_options={"rope_order": "psi-then-rope"})
    assert decoder_memory(psi_first)["kv_heads"] == 9  # no shared key before the rotation
    assert decoder_memory(cfg)["training_state_bytes"] == 20 * 134_515_008


def test_params_and_memory_commands_print_the_whole_model(capsys):
    assert main(["params", "--preset", "llama-135m", "--kinds", "gqa,mhe-mul"]) == 0
    out = capsys.readouterr().out
    assert "134,515,008" in out and "SwiGLU, 3 matrices" in out and "tied to the embeddings" in out
    assert main(["memory", "--preset", "llama-1.1b", "--kinds", "gqa"]) == 0
    out = capsys.readouterr().out
    assert "1,100,048,384" in out and "KV cache / token" in out


def test_params_and_memory_include_the_presets_own_kind_by_default(capsys):
    """Without --kinds the preset's own kind (gqa for the Llama presets) joins the paper's seven,
    so the published totals appear (issue 45); an encoder preset keeps exactly the paper's seven."""
    assert main(["params", "--preset", "llama-135m"]) == 0
    out = capsys.readouterr().out
    assert "134,515,008" in out and "| gqa " in out and "| mhe-mul " in out
    assert main(["memory", "--preset", "llama-1.1b"]) == 0
    out = capsys.readouterr().out
    assert "1,100,048,384" in out and "| gqa " in out
    assert main(["params", "--preset", "bert-base", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == list(PAPER_KINDS)
