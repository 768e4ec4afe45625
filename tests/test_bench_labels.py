"""``mhe bench`` in smoke sizes says what it measured: the shrunk shape, and KV caches in a unit
that shows them (they are KiB, not 0.0 MiB)."""

import json
import re

import pytest

from mhe.cli import main


def test_smoke_bench_names_the_shape_and_a_readable_cache_unit(capsys, tmp_path):
    assert main(["bench", "--smoke", "--sections", "train,decode", "--kinds", "mha,mhe-mul", "--reps", "1",
                 "--presets", "gpt2-base", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    # the training section times the step alone and mhe pretrain's trainer, side by side
    rows = json.loads((tmp_path / "b.json").read_text())["training"]
    assert [(r["kind"], r["path"]) for r in rows] == [("mha", "step"), ("mha", "mhe pretrain"),
                                                      ("mhe-mul", "step"), ("mhe-mul", "mhe pretrain")]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "every model shrunk to 2 layers, width 64" in out
    assert "2L x 64 (4 heads), vocab 512" in out  # the training rows name the shape measured
    assert "KV cache KiB" in out and "KV KiB total" in out
    cells = re.findall(r"\|\s+(\d+\.\d)\s+\|\s*$", out, flags=re.M)  # the last column of each table row
    assert cells and all(float(c) > 0 for c in cells)


def test_bench_config_keeps_the_presets_grouping():
    """``--preset llama-135m``: GQA is the preset's 3 K/V heads; the GPT-2 presets keep the generate
    section's 4; smoke sizes use 2 (of 4 heads)."""
    from mhe.bench.common import bench_config

    assert bench_config("llama-135m", "gqa", small=False).attn_options.n_kv_heads == 3
    assert bench_config("llama-135m", "gqa", small=False, gqa_heads=4).attn_options.n_kv_heads == 3
    assert bench_config("gpt2-base", "gqa", small=False, gqa_heads=4).attn_options.n_kv_heads == 4
    small = bench_config("llama-135m", "gqa", small=True, max_len=64)
    assert (small.n_heads, small.attn_options.n_kv_heads, small.max_len, small.positions) == (4, 2, 64, "rotary")
    assert bench_config("llama-135m", "mhe-mul", small=False).attention == "mhe-mul"


@pytest.mark.slow
def test_smoke_bench_of_a_llama_preset_generates_beside_hf_llama(capsys, tmp_path):
    assert main(["bench", "--smoke", "--sections", "generate", "--kinds", "gqa,mhe-mul", "--reps", "1",
                 "--preset", "llama-tiny", "--json", str(tmp_path / "b.json")]) == 0
    rows = json.loads((tmp_path / "b.json").read_text())["generate"]
    assert {r["path"] for r in rows} == {"HF LlamaForCausalLM.generate", "model.generate (eager)"}
    kv = {(r["batch"], r["kind"]): r["kv_bytes"] for r in rows if r["kv_bytes"] is not None}
    assert kv[(1, "gqa")] == 2 * kv[(1, "mhe-mul")] > 0  # 2 K/V heads against MHE's one
