"""``benchmarks/uptrain.py study`` (``benchmarks/uptraining/study.py``): its plan is made of commands the ``mhe`` parser takes, with
the documented uptraining recipe, for the GPT-2-shaped and the Llama-style decoder; the CPU
smoke run end to end (every stage, in one process) is a slow test."""

import json
import shlex
import sys
from pathlib import Path

import pytest

from conftest import require_data
from mhe.cli import build_parser

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
KINDS = ["mqa", "gqa", "mhe-mul", "mhe-add", "sha"]


def study():
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    from uptraining import study as mod

    return mod


def plan(tmp_path, capsys, *extra):
    assert study().main(["--out", str(tmp_path / "s"), "--data-dir", "data", "--dry-run", *extra]) == 0
    out = capsys.readouterr()
    parser = build_parser()
    return [parser.parse_args(shlex.split(line)[1:]) for line in out.out.splitlines()], out.err


def test_the_plan_is_valid_mhe_commands(tmp_path, capsys):
    cmds, _ = plan(tmp_path, capsys)
    assert len(cmds) == 1 + 5 + 5 * 2 * 3  # pre-training, scratch, kinds x fractions x seeds
    assert all(c.command == "pretrain" for c in cmds)
    pre, scratch, up = cmds[0], cmds[1], cmds[6]
    assert pre.attention == "mha" and "train.steps=2000" in pre.set and pre.data == "offline-english"
    assert scratch.attention == "mqa" and "train.steps=2200" in scratch.set  # N + the longest uptraining
    assert up.init_from.endswith("convert-mqa") and up.attention is None and "train.steps=100" in up.set
    assert not any(s.startswith(("model.", "train.warmup")) for s in up.set)  # the recipe's own defaults


def test_the_llama_plan_builds_and_keeps_the_presets_kv_heads(tmp_path, capsys):
    """``--preset llama-135m``: every run's configuration and conversion is checked, GQA has the preset's 3 K/V heads from scratch and converted alike, and
    MHE keeps one K/V head (rope-then-psi)."""
    cmds, err = plan(tmp_path, capsys, "--preset", "llama-135m", "--seeds", "1")
    assert len(cmds) == 1 + 5 + 5 * 2
    assert cmds[0].preset == "llama-135m" and "model.max_len=256" in cmds[0].set
    gqa = next(c for c in cmds if c.attention == "gqa")
    assert "model.attn_options.n_kv_heads=3" in gqa.set
    lines = dict(line.split(": ", 1) for line in err.splitlines())
    assert set(lines) == {"mha", *KINDS}
    assert "n_kv_heads=3" in lines["gqa"] and "23,040 B of KV cache" in lines["gqa"]  # 30 layers x 2 x 3 x 64 x 2 B
    for kind in ("mhe-mul", "mhe-add"):
        assert "rope_order='rope-then-psi'" in lines[kind] and "7,680 B of KV cache" in lines[kind]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-decoder", "llama-tiny"])
def test_cpu_smoke_runs_end_to_end(tmp_path, preset):
    root = require_data("wikitext-2/wiki.train.tokens.xz", "wikitext-2/wiki.valid.tokens.gz",
                        "wikitext-2/wiki.test.tokens.gz")
    out = tmp_path / "smoke"
    assert study().main(["--cpu-smoke", "--preset", preset, "--data-dir", str(root), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["kind"] for r in summary["rows"]] == ["mha", *KINDS]
    assert summary["rows"][0]["ppl_converted"] > 1  # the source, scored
    for r in summary["rows"][1:]:  # every stage ran for every kind
        assert r["ppl_converted"] > 1 and r["ppl_naive"] > 1 and r["ppl_scratch"] > 1
        assert r["ppl_up_25pct"] > 1 and r["seeds_up_25pct"] == 1
    assert all(v is not None for v in summary["scores"].values()) and len(summary["scores"]) == 1 + 5 + 5
    assert (out / "uptrain.png").stat().st_size > 0
    assert (out / "summary.md").read_text().count("\n") == 2 + 6
    run_md = (out / "RUN.md").read_text()
    for part in ("## Reproduce", "## This run", "## What ran", "Same total steps", "| uptrain-sha-25pct-seed0 |"):
        assert part in run_md
    assert str(root) not in run_md and '--data-dir "$MHE_DATA"' in run_md  # no path of this machine
    assert ("rope_order=rope-then-psi" in run_md) == (preset == "llama-tiny")
    record = json.loads((out / "runs" / "convert-mhe-mul" / "config.json").read_text())
    assert record["model"]["positions"] == ("rotary" if preset == "llama-tiny" else "learned")
    assert record["model"]["attn_options"]["rope_order"] == "rope-then-psi"


def test_the_llama_6x512_plan_has_the_comparisons_shape_and_scores_ptb(tmp_path, capsys):
    """``--preset llama-6x512`` (issue 43): llama-135m's layer at the from-scratch comparison's shape
    (6 x 512, 8 heads of 64), GQA with 2 K/V heads, 1200 steps, four kinds, every run scored on PTB too."""
    cmds, err = plan(tmp_path, capsys, "--preset", "llama-6x512")
    kinds = ["mqa", "gqa", "mhe-mul", "mhe-add"]
    assert len(cmds) == 1 + 4 + 4 * 2 * 3
    pre = cmds[0]
    assert pre.preset == "llama-135m" and "train.steps=1200" in pre.set and "train.steps=1320" in cmds[1].set
    for item in ("model.n_layers=6", "model.d_model=512", "model.n_heads=8", "model.d_ff=1408", "model.max_len=256"):
        assert item in pre.set
    assert all('data.task_options.also_test=["ptb"]' in c.set for c in cmds)  # uptraining runs too
    assert [c.attention for c in cmds[1:5]] == kinds and all(c.init_from for c in cmds[5:])
    assert [c.set for c in cmds[5:]][0].count("train.steps=60") == 1  # 5% of 1200
    lines = dict(line.split(": ", 1) for line in err.splitlines())
    assert set(lines) == {"mha", *kinds}
    # 2 (K and V) x 6 layers x cached heads x 64 x 2 bytes
    assert "12,288 B of KV cache" in lines["mha"] and "3,072 B of KV cache" in lines["gqa"]
    assert "n_kv_heads=2" in lines["gqa"] and "1,536 B of KV cache" in lines["mhe-mul"]


@pytest.mark.slow
def test_the_llama_6x512_study_runs_end_to_end_on_a_tiny_model(tmp_path):
    """The Llama-style source through every stage at the smoke size, with the per-word table (WikiText-2
    and PTB) beside the per-token one."""
    root = require_data("wikitext-2/wiki.train.tokens.xz", "wikitext-2/wiki.valid.tokens.gz",
                        "wikitext-2/wiki.test.tokens.gz", "ptb")
    out = tmp_path / "smoke"
    assert study().main(["--cpu-smoke", "--preset", "llama-6x512", "--data-dir", str(root), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [r["kind"] for r in summary["rows"]] == ["mha", "mqa", "gqa", "mhe-mul", "mhe-add"]
    src = summary["rows"][0]
    assert src["word_converted"] > src["ppl_converted"] > 1 and src["ptb_source"] > 1
    for r in summary["rows"][1:]:
        assert r["word_converted"] > 1 and r["word_up_25pct"] > 1 and r["word_scratch"] > 1
        assert r["ptb_up_25pct"] > 1 and r["ptb_scratch"] > 1
    table = (out / "summary.md").read_text()
    assert "| kind | WikiText-2 converted (step 0) |" in table and "PTB from scratch |" in table
    record = json.loads((out / "runs" / "convert-mhe-mul" / "config.json").read_text())
    assert record["model"]["positions"] == "rotary" and record["model"]["mlp"] == "swiglu"


@pytest.mark.slow
def test_a_second_call_keeps_what_finished_and_resumes_what_was_stopped(tmp_path):
    """The study over two device calls: a second call into the same folder keeps the finished runs
    and the conversions (no run starts again, the table is the same), and a run whose results were
    lost but whose folder holds its run continues it with ``--resume``."""
    root = require_data("wikitext-2/wiki.train.tokens.xz", "wikitext-2/wiki.valid.tokens.gz",
                        "wikitext-2/wiki.test.tokens.gz")
    out = tmp_path / "smoke"
    argv = ["--cpu-smoke", "--preset", "tiny-decoder", "--data-dir", str(root), "--out", str(out)]
    assert study().main(argv) == 0
    first = json.loads((out / "summary.json").read_text())["rows"]
    stopped = out / "runs" / "uptrain-mqa-25pct-seed0"
    (stopped / "results.json").unlink()  # as if stopped at the budget before it finished
    assert study().main(argv) == 0
    log = (out / "study.log").read_text().split("uptraining study on")[-1]
    assert log.count("[kept]") == 1 + 5 + 5 - 1 and "[convert] kept from an earlier call" in log
    assert "[start] uptrain-mqa-25pct-seed0" in log and "[start] scratch" not in log
    assert "[resume] uptrain-mqa-25pct-seed0" in log and (stopped / "results.json").is_file()
    assert json.loads((out / "summary.json").read_text())["rows"] == first
