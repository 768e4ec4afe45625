"""mhe compare: aggregation against hand-computed values, resume of an interrupted sweep,
report regeneration, refusal of a folder holding another comparison."""

import json
import statistics

import pytest

from mhe.cli import main
from mhe.errors import MheError
from mhe.experiments.summary import aggregate, paper_columns
from mhe.experiments.sweep import Sweep, check_sweep_dir, run_sweep
from mhe.training.checkpoint import list_checkpoints


def result(kind, seed, score, params, metric="accuracy", hib=True):
    return {"task": "t", "metric": metric, "higher_is_better": hib, "attention": kind, "seed": seed,
            "score": score, "attention_params": params}


def test_aggregate_direct_metric_by_hand():
    runs = [result("sha", 0, 0.60, 100), result("sha", 1, 0.62, 100),
            result("mha", 0, 0.80, 400), result("mha", 1, 0.84, 400),
            result("mhe-mul", 0, 0.70, 103), result("mhe-mul", 1, 0.74, 103)]
    s = aggregate(runs)
    rows = {r["kind"]: r for r in s["rows"]}
    assert [r["kind"] for r in s["rows"]] == ["sha", "mha", "mhe-mul"]
    assert rows["mha"]["mean"] == pytest.approx(0.82) and rows["mha"]["std"] == pytest.approx(statistics.stdev([0.8, 0.84]))
    assert rows["mhe-mul"]["prr"] == pytest.approx(0.72 / 0.82)
    assert rows["mhe-mul"]["peop"] == pytest.approx((0.72 / 0.61 - 1) / (103 / 100 - 1))
    assert rows["mha"]["peop"] == pytest.approx((0.82 / 0.61 - 1) / 3)
    assert rows["sha"]["peop"] is None and rows["mha"]["prr"] == 1.0


def test_aggregate_inverse_metric_by_hand():
    runs = [result("sha", 0, 60.0, 100, "perplexity", False), result("mha", 0, 40.0, 400, "perplexity", False),
            result("mhe-add", 0, 50.0, 103, "perplexity", False)]
    rows = {r["kind"]: r for r in aggregate(runs)["rows"]}
    assert rows["mhe-add"]["prr"] == pytest.approx(1 - (50 - 40) / 40)
    assert rows["mhe-add"]["peop"] == pytest.approx(-(50 / 60 - 1) / 0.03)
    assert rows["mhe-add"]["peop"] > 0 and rows["sha"]["std"] == 0.0


def test_a_spread_is_printed_only_over_several_seeds():
    from mhe.experiments.summary import markdown

    two = markdown(aggregate([result("sha", 0, 0.60, 100), result("sha", 1, 0.62, 100)]))
    one = markdown(aggregate([result("sha", 0, 0.60, 100), result("mha", 0, 0.8, 400)]))
    assert "| SHA | 0.000M | 0.61 ± 0.014 | 2 |" in two
    assert "| SHA | 0.000M | 0.6 | 1 |" in one and "±" not in one.split("\n", 2)[2]


def test_every_plot_colours_a_kind_the_same(tmp_path, monkeypatch):
    """The score plot, the training curves and the PRR bars draw each kind in its one colour."""
    from mhe.accounting.scaling import COLOURS
    from mhe.experiments import plots

    assert len(set(COLOURS.values())) == len(COLOURS)
    drawn = {}

    class Recorder:
        def __getattr__(self, name):
            def call(*args, **kw):
                if name in ("errorbar", "plot") and "label" in kw:
                    drawn.setdefault(name, {})[kw["label"]] = kw.get("color")
                if name == "bar" and isinstance(kw.get("color"), list):
                    drawn.setdefault("bar", []).append(kw["color"])
                return Recorder()
            return call

        def get_lines(self):
            return [1]

    monkeypatch.setattr(plots, "_plt", lambda: type("P", (), {"subplots": staticmethod(lambda **kw: (Recorder(), Recorder())),
                                                               "close": staticmethod(lambda f: None)}))
    runs = [{"attention": k, "run_dir": str(tmp_path), "seed": 0} for k in ("mhe-mul", "sha", "mha")]
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    plots.plot_curves(runs, tmp_path / "c.png")
    summary = aggregate([result(k, 0, 0.5, 100) for k in ("sha", "mha", "mhe-mul")])
    plots.plot_score_vs_params(summary, tmp_path / "s.png")
    plots.plot_prr_vs_paper([("sha", 0.9, 0.5), ("mhe-mul", 1.0, 0.8)], "t", tmp_path / "p.png")
    want = {plots.LABELS[k]: COLOURS[k] for k in ("sha", "mha", "mhe-mul")}
    assert drawn["plot"] == want and drawn["errorbar"] == want
    assert drawn["bar"] == [[COLOURS["sha"], COLOURS["mhe-mul"]]] * 2


def test_paper_columns_reproduce_table_2():
    cols = paper_columns({}, "table2-ptb")["rows"]
    assert round(cols["mhe-mul"]["peop"], 2) == 81.76 and round(100 * cols["mhe-mul"]["prr"], 1) == 85.6


def test_paper_percentages_become_fractions_and_keep_prr():
    cols = paper_columns({}, "table1-cola")["rows"]
    assert cols["mha"]["score"] == pytest.approx(0.596) and cols["mhe-mul"]["score"] == pytest.approx(0.566)
    assert cols["mhe-mul"]["prr"] == pytest.approx(56.6 / 59.6)
    assert paper_columns({}, "table1-cb")["rows"]["mhe-mul"]["score"] == pytest.approx(0.894)


def test_aggregate_another_recorded_metric():
    runs = [{**result("sha", 0, 0.81, 100, "f1"), "accuracy": 0.70}, {**result("mha", 0, 0.82, 400, "f1"),
                                                                       "accuracy": 0.75}]
    rows = {r["kind"]: r for r in aggregate(runs, "accuracy")["rows"]}
    assert rows["sha"]["mean"] == 0.70 and rows["mha"]["mean"] == 0.75
    assert aggregate(runs, "accuracy")["metric"] == "accuracy"
    with pytest.raises(MheError, match=r"has no metric 'spearman'; valid: accuracy"):
        aggregate(runs, "spearman")


SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "train.batch_size=16", "train.steps=8",
         "train.save_every=4", "train.log_every=2",
         'data.task_options={"train_size": 128, "test_size": 32, "pairs": 4, "queries": 4}']


def test_sweep_resumes_and_report_rebuilds(tmp_path, capsys):
    out = tmp_path / "cmp"
    sweep = Sweep("recall", "tiny-decoder", ["sha", "mha", "mhe-mul"], 2, overrides=list(SMALL))
    # an interrupted sweep: one run stopped half way (as a killed job leaves it)
    from mhe.experiments.sweep import run_config
    from mhe.tasks.recall import RecallTask
    from mhe.training.loop import Trainer

    cfg = run_config(sweep, "mha", 1)
    cfg.train.stop_at = 4
    Trainer(cfg, RecallTask(), out / "runs" / "mha-seed1", log=lambda m: None).fit()
    assert [p.name for p in list_checkpoints(out / "runs" / "mha-seed1" / "checkpoints")] == ["step-00000004"]
    log = []
    with pytest.raises(MheError, match=r"holds 1 unfinished run\(s\) of this comparison \(mha seed 1\); pass --resume"):
        run_sweep(sweep, out, workers=1, log=log.append)  # unfinished runs continue only with --resume
    summary = run_sweep(sweep, out, workers=1, resume=True, log=log.append)
    assert any(m == "[resume] mha seed 1" for m in log)
    assert sum(m.startswith("[start]") for m in log) == 5
    assert {r["kind"]: r["n_seeds"] for r in summary["rows"]} == {"sha": 2, "mha": 2, "mhe-mul": 2}
    saved = json.loads((out / "summary.json").read_text())
    assert set(saved) >= {"task", "metric", "higher_is_better", "rows"}
    assert set(saved["rows"][0]) >= {"kind", "attention_params", "mean", "std", "n_seeds", "prr", "peop"}
    assert saved["rows"][0]["peop"] is None  # SHA
    for f in ("summary.md", "summary.csv", "score_vs_params.png", "training_curves.png"):
        assert (out / f).stat().st_size > 0
    # rerunning reports the finished comparison and trains nothing
    log.clear()
    run_sweep(sweep, out, workers=1, log=log.append)
    assert log == [f"already finished: results in {out}"]
    # report rebuilds the same numbers from the runs alone
    before = (out / "summary.json").read_text()
    for f in ("summary.json", "summary.md", "summary.csv"):
        (out / f).unlink()
    # a paper table of another metric (perplexity beside recall accuracy) is refused, nothing written
    assert main(["report", str(out), "--paper", "table2-ptb"]) == 2
    assert not (out / "summary.json").exists()
    assert "'table2-ptb' reports perplexity" in capsys.readouterr().err
    assert main(["report", str(out), "--paper", "table2-glue"]) == 0
    again = json.loads((out / "summary.json").read_text())
    assert again["rows"] == json.loads(before)["rows"]
    assert again["paper"]["table"] == "table2-glue" and "paper accuracy" in capsys.readouterr().out


def test_folder_with_another_comparison_is_refused(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"sweep": Sweep("recall", "tiny-decoder", ["mha"], 1,
                                                                overrides=[]).identity()}))
    with pytest.raises(MheError, match=r"holds a different comparison \(kinds: \['mha'\] there, \['sha'\] now\)"):
        run_sweep(Sweep("recall", "tiny-decoder", ["sha"], 1, overrides=[]), out)


def test_more_seeds_and_operational_settings_extend_a_comparison(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    first = Sweep("lm", "gpt2-base", ["mha"], 2, overrides=["train.steps=600", "train.save_every=100"])
    (out / "sweep.json").write_text(json.dumps({"sweep": first.identity()}))
    check_sweep_dir(out, Sweep("lm", "gpt2-base", ["mha"], 3,
                               overrides=["train.steps=600", "train.save_every=0", "train.keep_checkpoints=false"]))
    with pytest.raises(MheError, match=r"train.steps: 600 there, 700 now"):
        check_sweep_dir(out, Sweep("lm", "gpt2-base", ["mha"], 3, overrides=["train.steps=700"]))


def test_added_kinds_extend_a_comparison(tmp_path):
    out = tmp_path / "cmp"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"sweep": Sweep("lm", "gpt2-base", ["mha", "mhe-mul"], 3).identity()}))
    check_sweep_dir(out, Sweep("lm", "gpt2-base", ["mha", "mhe-mul", "mhe-add"], 3))
    with pytest.raises(MheError, match=r"kinds: \['mha', 'mhe-mul'\] there, \['mha', 'mhe-add'\] now"):
        check_sweep_dir(out, Sweep("lm", "gpt2-base", ["mha", "mhe-add"], 3))


@pytest.mark.parametrize("argv, match", [
    (["compare", "--kinds", "mha,nope"], "unknown attention kind 'nope'"),
    (["compare", "--preset", "huge"], "unknown preset 'huge'; valid: cpu-recall"),
    (["compare", "--set", "train.nope=1", "--out", "/nonexistent/x"], "unknown setting 'train.nope'"),
    (["compare", "--paper", "table9"], "unknown paper table 'table9'"),
])
def test_compare_bad_input(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


def test_pretrain_then_finetune_comparison(tmp_path, capsys):
    from conftest import require_data

    root = require_data("ptb/ptb.train.txt.gz", "glue/RTE/dev.tsv.gz")
    pre = tmp_path / "mlm"
    assert main(["compare", "--preset", "cpu-mlm", "--kinds", "mha,mhe-mul", "--data", "ptb", "--data-dir", str(root),
                 "--workers", "1", "--out", str(pre), "--set", "train.steps=3", "--set", "data.limit_lines=500",
                 "--set", "data.vocab_size=300"]) == 0
    ft = tmp_path / "rte"
    assert main(["compare", "--task", "rte", "--pretrained", str(pre), "--kinds", "mha,mhe-mul", "--seeds", "2",
                 "--data-dir", str(root), "--workers", "1", "--out", str(ft), "--set", "train.epochs=0",
                 "--set", "train.steps=2", "--set", "train.eval_every=0", "--set", "train.save_every=0", "--set", "train.batch_size=8",
                 "--set", 'data.task_options={"train_limit": 16, "dev_limit": 16}']) == 0
    assert f"on rte (the models of {pre})" in capsys.readouterr().err  # not the default preset's name
    s = json.loads((ft / "summary.json").read_text())
    assert s["metric"] == "accuracy" and [r["kind"] for r in s["rows"]] == ["mha", "mhe-mul"]
    assert all(r["n_seeds"] == 2 for r in s["rows"])
    cfg = json.loads((ft / "runs" / "mhe-mul-seed1" / "config.json").read_text())
    assert cfg["run"]["data"]["task_options"]["checkpoint"].endswith("mhe-mul-seed0")
    assert main(["compare", "--task", "rte", "--kinds", "mha", "--out", str(tmp_path / "x")]) == 2


def test_overview_averages_tasks_and_recomputes_prr(tmp_path, capsys):
    import json as _json

    from mhe.experiments.summary import overview, write_summary

    dirs = []
    for task, metric, scores in (("rte", "accuracy", {"sha": 0.50, "mha": 0.60, "mhe-mul": 0.58}),
                                 ("cola", "matthews_corrcoef", {"sha": 0.10, "mha": 0.20, "mhe-mul": 0.16})):
        d = tmp_path / task
        for kind, score in scores.items():
            run = d / "runs" / f"{kind}-seed0"
            run.mkdir(parents=True)
            params = {"sha": 100, "mha": 400, "mhe-mul": 103}[kind]
            (run / "results.json").write_text(_json.dumps({**result(kind, 0, score, params, metric), "task": task}))
        write_summary(d, paper_table=f"table1-{task}")
        dirs.append(d)
    md = overview(dirs, plot=tmp_path / "prr.png")
    assert (tmp_path / "prr.png").stat().st_size > 1000 and (dirs[0] / "prr_vs_paper.png").exists()
    row = next(line for line in md.splitlines() if line.startswith("| MHE-Mul"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "0.3700"                                       # (0.58 + 0.16) / 2
    assert cells[5] == f"{100 * 0.37 / 0.40:.1f}"                     # PRR of the averages
    assert cells[6] == f"{(0.37 / 0.30 - 1) / 0.03:.2f}"              # PEoP against SHA
    assert cells[7] == f"{(0.671 + 0.566) / 2:.4f}"                   # the paper's RTE and CoLA, as fractions
    assert "Paper: the same tasks' Table 1 scores" in md
    for d, task in zip(dirs, ("rte", "cola")):  # a decoder's fine-tuning sets the paper's Table 2 beside it
        write_summary(d, paper_table=f"table2-{task}")
    assert "Paper: the same tasks' Table 2 scores" in overview(dirs)
    assert main(["overview", str(dirs[0]), str(tmp_path / "missing")]) == 2
    assert "has no summary.json" in capsys.readouterr().err


def test_running_mean_for_training_curves():
    from mhe.experiments.plots import smooth

    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], parts=4) == [1.0, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5, 7.5]
    assert smooth([3.0, 1.0], parts=40) == [3.0, 1.0]  # shorter than one window: unchanged


def _comparison(root, task, metric, hib, scores, paper):
    from mhe.experiments.summary import write_summary

    params = {"sha": 100, "mha": 400, "mhe-mul": 103}
    for kind, score in scores.items():
        run = root / "runs" / f"{kind}-seed0"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps({**result(kind, 0, score, params[kind], metric, hib),
                                                      "task": task}))
    write_summary(root, paper_table=paper)
    return root


def test_overview_prr_of_a_perplexity_comparison_is_inverse(tmp_path):
    """Perplexity: PRR = 1 - (score - MHA) / MHA for ours and the paper's (section 4.6); the
    paper's SHA on PTB (68.1 against MHA's 44.3) keeps 46.3%, not 153.7%."""
    from mhe.experiments.summary import overview

    d = _comparison(tmp_path / "ptb", "lm", "perplexity", False, {"sha": 300.0, "mha": 200.0, "mhe-mul": 250.0},
                    "table2-ptb")
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in overview([d]).splitlines() if line.startswith("| ") and "Attention" not in line}
    assert rows["SHA"][4] == f"{100 * (1 - (300 - 200) / 200):.1f}" == "50.0"
    assert rows["MHE-Mul"][4] == f"{100 * (1 - (250 - 200) / 200):.1f}"
    assert rows["SHA"][7] == f"{100 * (1 - (68.1 - 44.3) / 44.3):.1f}" == "46.3"
    assert rows["MHE-Mul"][7] == f"{100 * (1 - (50.7 - 44.3) / 44.3):.1f}" == "85.6"  # Table 2's printed PRR
    wt2 = _comparison(tmp_path / "wt2", "lm", "perplexity", False, {"sha": 100.0, "mha": 80.0, "mhe-mul": 90.0},
                      "table2-wikitext-103")
    md = overview([d, wt2])  # two language-model comparisons: one column each, named by folder
    assert "| ptb (perplexity) | wt2 (perplexity) |" in md
    assert next(line for line in md.splitlines() if line.startswith("| SHA")).split("|")[5].strip() == "200.0000"


def test_overview_refuses_a_paper_table_of_another_metric(tmp_path, capsys):
    """A recall comparison summarised beside Table 2's PTB perplexities (``mhe compare`` accepts
    the table for its task only) is refused, as are comparisons whose metrics point different ways."""
    from mhe.experiments.summary import overview

    acc = _comparison(tmp_path / "recall", "recall", "accuracy", True, {"sha": 0.3, "mha": 0.6, "mhe-mul": 0.5},
                      "table2-ptb")
    with pytest.raises(MheError, match="reports perplexity, this comparison \\(recall\\) reports accuracy"):
        overview([acc])
    assert main(["overview", str(acc)]) == 2
    assert "153.7" not in capsys.readouterr().out
    ppl = _comparison(tmp_path / "ptb", "lm", "perplexity", False, {"sha": 300.0, "mha": 200.0, "mhe-mul": 250.0},
                      "")
    plain = _comparison(tmp_path / "plain", "recall", "accuracy", True, {"sha": 0.3, "mha": 0.6, "mhe-mul": 0.5},
                        "")
    with pytest.raises(MheError, match="point different ways"):
        overview([ppl, plain])


@pytest.mark.parametrize("arch,task,want", [("encoder", "rte", "table1-rte"), ("decoder", "rte", "table2-rte"),
                                            ("decoder", "stsb", "table2-stsb"), ("decoder", "cb", ""),
                                            ("encoder", "cb", "table1-cb")])
def test_finetuning_is_set_beside_the_paper_table_of_its_architecture(tmp_path, arch, task, want):
    import argparse

    from mhe.cli.compare import build_sweep, compare_args

    run = tmp_path / "pre" / "runs" / "mha-seed0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"run": {}, "model": {"arch": arch}}))
    p = argparse.ArgumentParser()
    compare_args(p)
    argv = ["--task", task, "--pretrained", str(tmp_path / "pre"), "--kinds", "mha"]
    assert build_sweep(p.parse_args(argv))[1].paper == want
    assert build_sweep(p.parse_args(argv + ["--paper", ""]))[1].paper == ""  # an explicit choice wins


@pytest.mark.slow
def test_round_three_decoder_pretraining_then_glue_fine_tuning(tmp_path):
    """gpu-lm-glue (tiny settings) on offline-english, then a fine-tuning comparison from its
    decoder runs: beside the paper's decoder table (table2-rte), the checkpoint's model fine-tuned."""
    from conftest import require_data

    root = require_data("wikitext-2/wiki.train.tokens.xz", "glue/RTE/dev.tsv.gz", "superglue/AX-g/AX-g.jsonl.gz")
    tiny = sum((["--set", s] for s in ("train.steps=2", "train.batch_size=4", "model.n_layers=1", "model.d_model=32",
                                        "model.n_heads=4", "model.d_ff=64", "model.max_len=32")), [])
    pre = tmp_path / "decoder-lm"
    assert main(["compare", "--preset", "gpu-lm-glue", "--kinds", "mha", "--data-dir", str(root), "--workers", "1",
                 "--out", str(pre), *tiny, "--set", "data.limit_lines=100", "--set", "data.vocab_size=300"]) == 0
    run = json.loads((pre / "runs" / "mha-seed0" / "config.json").read_text())
    assert run["run"]["data"]["dataset"] == "offline-english" and run["model"]["arch"] == "decoder"
    assert list_checkpoints(pre / "runs" / "mha-seed0" / "checkpoints")  # what fine-tuning loads
    ft = tmp_path / "decoder-rte"
    assert main(["compare", "--task", "rte", "--pretrained", str(pre), "--kinds", "mha", "--seeds", "1",
                 "--data-dir", str(root), "--workers", "1", "--out", str(ft), *tiny, "--set", "train.epochs=0",
                 "--set", "train.eval_every=0", "--set", "train.keep_checkpoints=false",
                 "--set", 'data.task_options={"train_limit": 8, "dev_limit": 8}']) == 0
    s = json.loads((ft / "summary.json").read_text())
    assert s["paper"]["table"] == "table2-rte" and s["rows"][0]["kind"] == "mha"
    assert json.loads((ft / "sweep.json").read_text())["paper"] == "table2-rte"
    cfg = json.loads((ft / "runs" / "mha-seed0" / "config.json").read_text())
    assert cfg["model"]["arch"] == "decoder" and cfg["model"]["head"] == "classification"


def test_perplexity_tables_name_their_unit():
    """A comparison's perplexity says per word or per token in its table (issue 45)."""
    from mhe.experiments.summary import markdown

    runs = [{**result(k, 0, s, p, "perplexity", False), "perplexity_per": "token", "word_perplexity": 2 * s}
            for k, s, p in (("sha", 120.0, 100), ("mha", 100.0, 400))]
    assert "| perplexity per token (mean ± std) |" in markdown(aggregate(runs))
    assert "| perplexity per word (mean ± std) |" in markdown(aggregate(runs, "word_perplexity"))
    assert "| accuracy (mean ± std) |" in markdown(aggregate([result("sha", 0, 0.5, 1), result("mha", 0, 0.6, 4)]))
