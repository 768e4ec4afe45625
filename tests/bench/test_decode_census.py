"""``benchmarks/decode.py census`` at smoke sizes on a CPU (leaf aten operators stand in for
kernels): one layer's run of operators is found, a deeper model adds exactly that run a layer, and
the command writes its rows beside the floor's."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # decode.py's commands: ``decoding.*``
from decoding import census, floor  # noqa: E402


def test_layer_run_finds_the_repeating_block_past_a_prologue_and_a_different_last_layer():
    names = ["emb", "n0", "mm", "att", "mm", "add", "n", "mm", "att", "mm", "add", "n", "mm", "att", "mm", "add",
             "head", "argmax"]
    assert census.layer_run(names, 3) == (2, 5)  # over 2 of the 3 layers: the last one fuses with the head
    assert census.layer_run(["a", "b", "c"], 3) == (0, 0)
    assert census.layer_run(["x", "a", "b", "a", "b", "y"], 2) == (1, 2)
    assert census.layer_run(["x", "a", "a", "b", "a", "a", "b", "y"], 2) == (1, 3)  # not the "a", "a" inside


def test_a_layer_repeats_when_inductor_numbers_its_kernels_apart_in_alternate_layers():
    """Compiled steps generate a layer's RMSNorm twice (``_15`` in even layers, ``_12`` in odd
    ones): the census compares names without that number, so the layer repeats over every layer
    (without it, no run repeats and the per-layer table came out empty on the GPU)."""
    layer = lambda serial: [f"triton_per_fused_add_mean_rsqrt_{serial}", "nvjet_sm90_tst_24x64", "triton_poi_fused_silu_3"]
    names = ["embedding"] + layer(15) + layer(12) + layer(15) + layer(12) + ["head"]
    kernels = [(n, 1.0) for n in names]
    got = census.census(kernels, 4)
    assert (got["kernels_per_layer"], got["layers_repeating"], got["outside_layers"]) == (3, 4, 2)
    assert census.layer_run(names, 4) == (1, 6)  # the raw names repeat every two layers only
    assert census.kernel_family("triton_red_fused_mm_10") == "triton_red_fused_mm"
    assert census.kernel_family("nvjet_sm90_tst_24x64_64x16_4x2_h_bz_TNN") == "nvjet_sm90_tst_24x64_64x16_4x2_h_bz_TNN"


def step_census(kind: str, layers: int) -> dict:
    torch.manual_seed(0)
    cfg = floor.bench_config("llama-135m", kind, small=True, max_len=100, dropout=0.0,
                             attn_dropout=0.0).replace(n_layers=layers)
    model = floor.build_model(cfg).eval()
    fn, _ = floor.decode_step(model, 2, 40, dev=torch.device("cpu"), dtype=torch.float32, mode="eager")
    return census.census(census.launches(fn, torch.device("cpu"), 3), layers)


def test_a_deeper_model_adds_one_layer_run_a_layer(monkeypatch):
    from mhe.attention import kv_cache

    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # Triton's interpreter would count its own operators
    for kind in ("mha", "mhe-mul"):
        two, five = step_census(kind, 2), step_census(kind, 5)
        assert five["layers_repeating"] >= 3 and five["kernels_per_layer"] > 0
        assert five["kernels_per_step"] - two["kernels_per_step"] == 3 * five["kernels_per_layer"]
        assert {"product", "attention"} <= set(five["per_layer_by_category"])
        assert sum(v["launches"] for v in five["per_category"].values()) == five["kernels_per_step"]


def test_census_command_writes_its_rows_beside_the_floor_rows(tmp_path, capsys):
    census.main(["--cpu-smoke", "--mode", "graph", "--kinds", "mha,gqa", "--no-prefill", "--census-reps", "2",
                 "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode-census-cpu.json").read_text())
    steps = json.loads((tmp_path / "decode-floor-cpu.json").read_text())
    assert [(r["kind"], r["batch"]) for r in rows] == [(r["kind"], r["batch"]) for r in steps] == [
        ("mha", 1), ("mha", 2), ("gqa", 1), ("gqa", 2)]
    assert all(r["counted"] == "leaf aten operators" and r["kernels_per_layer"] > 0 for r in rows)
    assert "| llama-135m | gqa | 2 |" in capsys.readouterr().out


def test_prefill_command_rows_scale_to_the_batch_and_count_the_floor_flops(tmp_path):
    from decoding import prefill

    prefill.main(["--cpu-smoke", "--presets", "llama-135m", "--kinds", "mhe-mul", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode-prefill-cpu.json").read_text())
    assert [(r["rows"], r["batch"], r["prompt"]) for r in rows] == [(2, 4, 40), (4, 4, 40)]
    model = floor.build("llama-135m", "mhe-mul", 41, torch.device("cpu"), torch.float32, small=True)
    for r in rows:
        assert r["flops_per_call"] == floor.prefill_flops(model, r["rows"], 40)
        assert abs(r["ms"] - r["ms_per_call"] * 4 / r["rows"]) <= 0.02 and r["fraction_of_peak"] is None
        assert "compiled_ms" not in r  # no --compiled
        assert abs(r["tokens_per_s"] - r["rows"] * 40 / (r["ms_per_call"] / 1e3)) <= 0.01 * r["tokens_per_s"] + 1


def test_the_compiled_prefill_equals_the_eager_one_and_scales_as_its_row(tmp_path, capsys, monkeypatch):
    """``--compiled`` (aot_eager on a CPU, float32): ``generate``'s own compiled prefill (prompts
    from a lowered ``PREFILL_COMPILE_TOKENS``) ran, its logits equal the eager prefill's to float32
    rounding, its milliseconds scale to the batch as the row's do, and the table gains its
    columns; without it the rows have none."""
    from decoding import prefill
    from mhe.generation import session as sessions

    monkeypatch.setattr(sessions, "PREFILL_GRAPH_TOKENS", 60)
    monkeypatch.setattr(sessions, "PREFILL_COMPILE_TOKENS", 61)
    prefill.main(["--cpu-smoke", "--presets", "llama-135m", "--kinds", "mhe-mul", "--out", str(tmp_path),
                  "--compiled"])
    rows = json.loads((tmp_path / "decode-prefill-cpu.json").read_text())
    assert len(rows) == 2
    for r in rows:
        assert r["compiled"] and r["compiled_rel_diff"] < 1e-5 and r["compile_s"] >= 0
        assert r["compiled_fraction_of_peak"] is None
        assert abs(r["compiled_ms"] - r["compiled_ms_per_call"] * 4 / r["rows"]) <= 0.02
    assert "| compiled ms (batch) | compiled, of peak | compile s | logits' difference |" in capsys.readouterr().out
