"""The Llama-style from-scratch comparison (issue 43, ``mhe compare --preset gpu-llama-6x512``):
seven entries with MHE-Mul in both rotary orders, rows named by kind and rotary order, the
KV cache per token, a second test set tabulated beside the first, PRR and PEoP recomputable
from the table's means; a tiny run of the preset end to end (slow)."""

import csv
import json

import pytest

from conftest import require_data
from mhe.accounting.memory import decoder_memory
from mhe.cli import main
from mhe.errors import MheError
from mhe.experiments.entries import Entry, entry_dir, entry_kind, parse_entries, parse_entry, row_name
from mhe.experiments.presets import experiment
from mhe.experiments.summary import write_summary
from mhe.experiments.sweep import Sweep, run_config

ENTRIES = ["mha", "gqa", "mqa", "sha", "mhe-add rope-then-psi", "mhe-mul rope-then-psi", "mhe-mul psi-then-rope"]


def test_the_preset_builds_seven_entries_with_distinct_rows():
    exp = experiment("gpu-llama-6x512")
    assert list(exp.kinds) == ENTRIES and exp.seeds == 3
    cfgs = {e: exp.run_config(e, 2) for e in exp.kinds}
    rows = [row_name(c.model.to_dict()) for c in cfgs.values()]
    assert rows == ENTRIES  # the row names what ran: the kind, and for MHE the rotary order
    assert len({entry_dir(e) for e in exp.kinds}) == 7
    for e, c in cfgs.items():
        m = c.model
        assert (m.attention, m.positions, m.norm, m.mlp) == (entry_kind(e), "rotary", "rmsnorm", "swiglu")
        assert (m.n_layers, m.d_model, m.n_heads, m.resolved_head_dim, m.max_len) == (6, 512, 8, 64, 256)
        assert c.train.seed == 2 and c.data.dataset == "offline-english"
        assert c.data.task_options.also_test == ["ptb"] and c.train.compile is False and c.train.steps == 600
    assert cfgs["gqa"].model.attn_options.n_kv_heads == 2
    assert cfgs["mhe-mul psi-then-rope"].model.attn_options.rope_order == "psi-then-rope"
    assert cfgs["mhe-mul rope-then-psi"].model.attn_options.rope_order == "rope-then-psi"
    # 2 (K and V) x 6 layers x cached heads x 64 x 2 bytes: n heads for MHA and psi-then-rope, 2 for GQA, 1 else
    kv = {e: decoder_memory(c.model)["kv_cache_bytes_per_token"] for e, c in cfgs.items()}
    assert kv == {"mha": 12288, "gqa": 3072, "mqa": 1536, "sha": 1536, "mhe-add rope-then-psi": 1536,
                  "mhe-mul rope-then-psi": 1536, "mhe-mul psi-then-rope": 12288}


def test_entries_refuse_what_has_no_rotary_order():
    from mhe.attention import SPECS

    assert parse_entry("mhe-mul psi-then-rope") == Entry(SPECS["mhe-mul"], "psi-then-rope")
    assert parse_entry("mha") == Entry(SPECS["mha"])
    assert parse_entries("mha, mhe-mul  psi-then-rope") == ("mha", "mhe-mul psi-then-rope")
    with pytest.raises(MheError, match="kind 'mha' has no variants"):
        parse_entry("mha psi-then-rope")
    with pytest.raises(MheError, match="'psi-first'"):
        parse_entry("mhe-mul psi-first")
    with pytest.raises(MheError, match="names an entry twice"):
        parse_entries("mha,mha")
    # without rotary positions the order does not exist and the row is the kind alone
    assert row_name({"attention": "mhe-mul", "positions": "learned", "attn_options": {}}) == "mhe-mul"
    assert row_name({"attention": "mhe-mul", "positions": "rotary", "attn_options": {}}) == "mhe-mul rope-then-psi"


def _fake_run(root, entry, seed, wiki, ptb, params):
    """A finished run's two files as training writes them (results.json, config.json's model)."""
    kind = entry_kind(entry)
    d = root / "runs" / f"{entry_dir(entry)}-seed{seed}"
    d.mkdir(parents=True)
    cfg = experiment("gpu-llama-6x512").run_config(entry, seed)
    (d / "results.json").write_text(json.dumps({
        "task": "lm", "metric": "perplexity", "higher_is_better": False, "attention": kind, "seed": seed,
        "score": wiki / 2, "word_perplexity": wiki, "ptb_word_perplexity": ptb, "attention_params": params}))
    (d / "config.json").write_text(json.dumps({"run": cfg.to_dict(), "model": cfg.model.to_dict()}))


def test_the_summary_names_the_rotary_order_and_its_prr_peop_follow_the_means(tmp_path):
    scores = {"mha": ([30.0, 32.0], [50.0, 52.0], 1000), "sha": ([40.0, 42.0], [60.0, 64.0], 100),
              "mhe-mul rope-then-psi": ([34.0, 35.0], [55.0, 56.0], 110),
              "mhe-mul psi-then-rope": ([33.0, 36.0], [54.0, 58.0], 110)}
    for entry, (wiki, ptb, params) in scores.items():
        for seed in (0, 1):
            _fake_run(tmp_path, entry, seed, wiki[seed], ptb[seed], params)
    write_summary(tmp_path, metric="word_perplexity", also=("ptb_word_perplexity",), kv_cache=True)
    s = json.loads((tmp_path / "summary.json").read_text())
    assert [r["kind"] for r in s["rows"]] == ["sha", "mha", "mhe-mul rope-then-psi", "mhe-mul psi-then-rope"]
    for table, i in ((s["rows"], 0), (s["also"]["ptb_word_perplexity"]["rows"], 1)):
        rows = {r["kind"]: r for r in table}
        mha, sha = rows["mha"]["mean"], rows["sha"]["mean"]
        for kind, r in rows.items():
            assert r["mean"] == pytest.approx(sum(scores[kind][i]) / 2)
            assert r["prr"] == pytest.approx(1 - (r["mean"] - mha) / mha)  # section 4.6, lower is better
            if kind != "sha":
                assert r["peop"] == pytest.approx(-(r["mean"] / sha - 1) / (scores[kind][2] / 100 - 1))
    kv = {r["kind"]: r["kv_cache_bytes_per_token"] for r in s["rows"]}
    assert kv == {"sha": 1536, "mha": 12288, "mhe-mul rope-then-psi": 1536, "mhe-mul psi-then-rope": 12288}
    md = (tmp_path / "summary.md").read_text()
    assert "| MHE-Mul psi-then-rope | 0.000M | 12,288 B | 34.5 ± 2.1 | 2 |" in md
    assert "`ptb_word_perplexity`:" in md and "| MHA | 0.001M | 12,288 B | 51 ± 1.4 | 2 | 100.0 |" in md
    with open(tmp_path / "summary.csv") as f:
        head = next(csv.reader(f))
    assert head[:3] == ["kind", "attention_params", "kv_cache_bytes_per_token"]
    assert (tmp_path / "score_vs_kv_cache.png").stat().st_size > 0  # where the two rotary orders part


def test_a_sweep_runs_each_entry_in_its_own_folder(tmp_path):
    sweep = Sweep("lm", "llama-135m", ["mha", "mhe-mul psi-then-rope"], 1, "offline-english",
                  experiment="gpu-llama-6x512", also=("ptb_word_perplexity",), kv_cache=True)
    cfg = run_config(sweep, "mhe-mul psi-then-rope", 0)
    assert cfg.model.attn_options.rope_order == "psi-then-rope" and cfg.model.attention == "mhe-mul"
    assert "also" not in sweep.identity() and sweep.report()["also"] == ("ptb_word_perplexity",)


@pytest.mark.slow
def test_the_preset_runs_end_to_end_on_a_tiny_model(tmp_path, capsys):
    """The GPU command with tiny settings: three entries (both MHE-Mul orders), one seed, a few steps."""
    data = require_data("wikitext-2", "ptb", "multi30k", "glue", "superglue", "squad", "wmt14")
    out = tmp_path / "llama"
    tiny = ["train.steps=2", "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.max_len=16",
            "data.vocab_size=260", "data.limit_lines=20", "train.batch_size=2", "train.eval_every=1",
            "train.device=cpu", "train.warmup_steps=1", "data.eval_stride=8"]
    args = ["compare", "--preset", "gpu-llama-6x512", "--kinds", "mha,sha,mhe-mul rope-then-psi,mhe-mul psi-then-rope",
            "--seeds", "1", "--workers", "1", "--data-dir", str(data), "--out", str(out)]
    assert main(args + [a for s in tiny for a in ("--set", s)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert [r["kind"] for r in s["rows"]] == ["sha", "mha", "mhe-mul rope-then-psi", "mhe-mul psi-then-rope"]
    assert s["metric"] == "word_perplexity" and set(s["also"]) == {"ptb_word_perplexity"}
    res = json.loads((out / "runs" / "mhe-mul-psi-then-rope-seed0" / "results.json").read_text())
    assert res["ptb_word_perplexity"] > 1 and res["word_perplexity"] > 1
    assert main(["report", str(out)]) == 0  # rebuilt from sweep.json: the same rows and the PTB table
    assert "| MHE-Mul psi-then-rope |" in capsys.readouterr().out
