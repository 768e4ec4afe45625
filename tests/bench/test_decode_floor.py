"""``benchmarks/decode.py floor`` at smoke sizes on a CPU: its rows, the bytes a decode step must read
(paper-notes: every cached key and value of the context once plus every weight once), the floor
and the server rows' largest batch, written where the command says."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # decode.py's commands: ``decoding.*``
from decoding import floor as decode_floor  # noqa: E402


def test_floor_rows_bytes_and_server_rows(tmp_path):
    decode_floor.main(["--cpu-smoke", "--presets", "llama-135m", "--server-presets", "llama-135m",
                       "--kinds", "mha,mqa", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode-floor-cpu.json").read_text())
    assert [(r["kind"], r["batch"], r["context"]) for r in rows] == [
        ("mha", 1, 300), ("mha", 2, 300), ("mqa", 1, 300), ("mqa", 2, 300)]
    # smoke sizes: 2 layers, 4 heads of 16 (MQA: one K/V head), float32 on a CPU
    for r in rows:
        model = decode_floor.build("llama-135m", r["kind"], 364, torch.device("cpu"), torch.float32, small=True)
        emb = model.decoder.embed.tokens.weight
        tied = model.lm_head.weight is emb
        weights = sum(p.numel() for p in model.parameters()) * 4 - (0 if tied else emb.numel() * 4)
        heads = 4 if r["kind"] == "mha" else 1
        cache = 2 * 2 * heads * 16 * r["context"] * r["batch"] * 4  # L * 2 * h_kv * d * S * B * bytes
        assert r["bytes_per_step"] == cache + weights
        assert abs(r["fraction_of_bandwidth"] - r["floor_ms"] / r["step_ms"]) <= 1.5e-3  # of the unrounded times
        assert r["step_ms"] > 0 and r["prefill_ms"] > 0 and r["card"] == "cpu"
    run = json.loads((tmp_path / "decode-floor-cpu-run.json").read_text())
    bandwidth = run["copy_bandwidth_bytes_per_s"]
    for r in rows:
        assert abs(r["floor_ms"] - r["bytes_per_step"] / bandwidth * 1e3) <= 1e-4
    server = json.loads((tmp_path / "decode-server-cpu.json").read_text())
    assert [(r["kind"], r["context"], r["batch"]) for r in server] == [("mha", 300, 4), ("mqa", 300, 4)]
    for r in server:
        # tokens/s is rounded to a whole token and step_ms to 4 decimals: the bound of both roundings
        ms = r["step_ms"]
        bound = 0.5 + r["batch"] * 1e3 * 5e-5 / (ms * (ms - 5e-5))
        assert abs(r["decode_tokens_per_s"] - r["batch"] / ms * 1e3) <= bound


def test_compile_options_reach_torch_compile_and_the_row(tmp_path, monkeypatch):
    """``--compile-options`` (JSON) is what the compiled step is built with, as ``model.generate``'s
    ``compile_options`` are, and the row says so; a row without them has no such key."""
    seen = []

    def recording_compile_step(step, *, device, options=None):
        seen.append(options)
        return step

    monkeypatch.setattr(decode_floor, "compile_step", recording_compile_step)
    options = {"options": {"coordinate_descent_tuning": True}}
    common = ["--cpu-smoke", "--sections", "floor", "--presets", "llama-135m", "--kinds", "mqa", "--mode", "compile",
              "--no-prefill"]
    decode_floor.main(common + ["--compile-options", json.dumps(options), "--out", str(tmp_path / "with")])
    decode_floor.main(common + ["--out", str(tmp_path / "without")])
    assert seen == [options, options, None, None]  # batches 1 and 2, each run
    with_, without = (json.loads((tmp_path / d / "decode-floor-cpu.json").read_text()) for d in ("with", "without"))
    assert [r["compile_options"] for r in with_] == [options, options]
    assert all("compile_options" not in r for r in without)


def test_gate_up_both_times_one_product_and_two_side_by_side(tmp_path, monkeypatch):
    """``--gate-up both`` gives each (batch, context) two rows: the step with gate and up as one
    product (the library's rule) and with them apart; the view each step decodes with holds one
    stacked product or none, and the library's threshold is as it was afterwards."""
    from mhe.attention.fused_projections import fused_projection
    from mhe.models import layers

    stacked = []
    original = decode_floor.decode_view

    def spying(*a, **kw):
        view, plan = original(*a, **kw)
        stacked.append(any(fused_projection(m) is not None for m in view.modules() if isinstance(m, layers.SwiGLU)))
        return view, plan

    monkeypatch.setattr(decode_floor, "decode_view", spying)
    before = layers.FUSE_MAX_BYTES
    decode_floor.main(["--cpu-smoke", "--sections", "floor", "--presets", "llama-135m", "--kinds", "mqa",
                       "--no-prefill", "--gate-up", "both", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "decode-floor-cpu.json").read_text())
    assert [(r["batch"], r["gate_up"]) for r in rows] == [(1, "fused"), (1, "apart"), (2, "fused"), (2, "apart")]
    assert stacked == [True, False, True, False] and layers.FUSE_MAX_BYTES == before  # smoke batches 1 and 2
    assert "mqa (gate/up apart)" in decode_floor.floor_table(rows)
