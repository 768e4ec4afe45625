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


class _CountingPeer:
    """Stands in for a Hugging Face model: records how many new tokens each generate call asked for."""

    class config:
        vocab_size = 99

    def __init__(self):
        self.calls = []

    def generate(self, ids, *, max_new_tokens, **kw):
        self.calls.append(max_new_tokens)


def test_the_peer_times_a_prefill_and_some_tokens_and_counts_the_rest_at_their_rate(monkeypatch):
    import torch

    from mhe.bench import generate as gen

    peer = _CountingPeer()
    seconds = {1: 1.0, 4: 2.5, 8: 9.0}  # a call's seconds by its new tokens
    monkeypatch.setattr(gen, "_time", lambda fn, cuda, reps: (fn(), seconds[peer.calls[-1]])[1])
    sec, timed = gen._peer(peer, 2, 5, 8, dev=torch.device("cpu"), tokens=4)
    assert (sec, timed) == (1.0 + 1.5 * 7 / 3, 4)  # prefill 1.0, then 0.5 s per token for 7 more
    assert peer.calls == [8, 1, 4]  # warm-up, prefill-only, 4 new tokens
    assert gen._peer(peer, 2, 5, 8, dev=torch.device("cpu"), tokens=0) == (9.0, 8)  # every token timed


def test_generate_rows_past_the_deadline_are_skipped_and_listed(monkeypatch):
    import time

    import torch

    from mhe.bench import generate as gen

    monkeypatch.setattr(gen, "_our_model", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(gen, "_ours", lambda *a, **k: (time.sleep(0.2), (1.0, 64, 0.01, "sdpa", "eager"))[1])
    rows, skipped = gen.run_generate_section(["mha", "mqa"], [(1, 8, 8), (2, 8, 8)], dev=torch.device("cpu"),
                                             dtype=torch.float32, small=True, peer=True, deadline=0.1)
    assert [(r["batch"], r["kind"]) for r in rows] == [(1, "mha")]  # the first row started before the deadline
    assert skipped == ["mqa 1 x 8+8", "mha 2 x 8+8", "mqa 2 x 8+8", "HF 1 x 8+8", "HF 2 x 8+8"]


@pytest.mark.parametrize("graphs,mode", [(True, "auto"), (False, "eager")])
def test_the_generate_section_times_the_step_mode_a_default_call_takes(monkeypatch, graphs, mode):
    """The generate section's sessions take ``model.generate``'s default step mode (``auto``: the
    compiled step on a GPU), not ``graph``; ``--no-graphs`` times eager steps; the row names the
    mode the session ran."""
    import torch

    from mhe.bench import generate as gen

    asked = []
    monkeypatch.setattr(gen, "_our_model", lambda *a, **k: torch.nn.Linear(1, 1))
    monkeypatch.setattr(gen, "_ours", lambda *a, **k: (asked.append(k["mode"]), (1.0, 64, 0.01, "sdpa", "compile"))[1])
    rows, _ = gen.run_generate_section(["mha"], [(1, 8, 8)], dev=torch.device("cpu"), dtype=torch.float32,
                                       small=True, peer=False, graphs=graphs)
    assert asked == [mode] and rows[0]["path"] == "model.generate (compile)"


@pytest.mark.parametrize("option,value", [("--peer-tokens", "1"), ("--peer-tokens", "-2"), ("--gen-deadline", "-1")])
def test_bad_generate_caps_exit_2_in_one_line(option, value, capsys):
    assert main(["bench", "--smoke", "--sections", "generate", option, value]) == 2
    err = capsys.readouterr().err
    assert option in err and len(err.strip().splitlines()) == 1


def test_a_session_names_the_step_mode_that_ran_when_compiling_fails(monkeypatch):
    """A ``compile`` session whose step cannot compile runs its eager kernels (with a warning);
    ``step_mode_ran`` (the bench's row label) says so, where ``mode`` still names what was asked."""
    import warnings

    import torch

    from mhe.models import build_model
    from mhe.generation import step as captured_step

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no compiler here")
        return run

    model = build_model("tiny-decoder", attention="mha", d_model=32, d_ff=64, n_layers=1, vocab_size=64).eval()
    ids = torch.randint(0, 64, (1, 4))
    monkeypatch.setattr(captured_step.torch, "compile", lambda fn, **kw: fn)  # compiles (to itself) at once
    works = model.generator(1, 8, step_mode="compile")
    model.generate(ids, 2, session=works)
    assert works.step_mode_ran() == "compile"
    monkeypatch.setattr(captured_step.torch, "compile", broken)
    session = model.generator(1, 8, step_mode="compile")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model.generate(ids, 2, session=session)
    assert any("cannot compile" in str(w.message) for w in seen)
    assert session.mode == "compile" and session.step_mode_ran() == "eager (compile failed)"
