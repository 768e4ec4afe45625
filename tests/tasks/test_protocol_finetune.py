"""Fine-tuning protocol: explicit steps win over epochs, paper-* presets fine-tune five seeds."""

import argparse
import json

from mhe.experiments.presets import experiment
from mhe.cli import main
from mhe.cli.compare import PAPER_FINETUNE_SEEDS, build_sweep, compare_args
from mhe.training.config import RunConfig, apply_overrides
from mhe.tasks.finetune_config import finetune_train


def _ft_cfg(items):
    return apply_overrides(RunConfig(task="finetune", preset="tiny-encoder", train=finetune_train("cb")), items)


def test_explicit_steps_turn_the_default_epochs_off():
    assert _ft_cfg([]).train.epochs == 20  # Appendix B: up to 20 epochs
    cfg = _ft_cfg(["train.steps=10"])
    assert (cfg.train.steps, cfg.train.epochs) == (10, 0)
    cfg = _ft_cfg(["train.steps=10", "train.epochs=2"])  # the later one wins
    assert cfg.train.epochs == 2


def test_the_trainer_runs_the_explicit_steps(tmp_path):
    from mhe.tasks.recall import RecallTask
    from mhe.tasks import default_run
    from mhe.training.loop import Trainer

    small = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "train.batch_size=16", "train.progress=false",
             'data.task_options={"train_size": 256, "test_size": 32, "pairs": 4, "queries": 4}', "train.warmup_steps=1"]
    cfg = apply_overrides(default_run("recall", "tiny-decoder", "mha"), small + ["train.epochs=3", "train.steps=5"])
    res = Trainer(cfg, RecallTask(), tmp_path / "a", log=lambda *_: None).fit()
    assert res["step"] == 5  # 3 epochs would be 48 steps
    cfg = apply_overrides(default_run("recall", "tiny-decoder", "mha"), small + ["train.steps=5", "train.epochs=1"])
    res = Trainer(cfg, RecallTask(), tmp_path / "b", log=lambda *_: None).fit()
    assert res["step"] == 16  # 256 items // 16 a batch


def _args(argv):
    p = argparse.ArgumentParser()
    compare_args(p)
    return p.parse_args(argv)


def test_paper_presets_fine_tune_five_seeds_without_their_pretraining_settings():
    _, sweep = build_sweep(_args(["--preset", "paper-table1", "--task", "rte", "--pretrained", "x",
                                  "--set", "train.batch_size=16"]))
    assert sweep.seeds == PAPER_FINETUNE_SEEDS == 5
    assert sweep.overrides == ["train.batch_size=16"]  # not paper-table1's 1M steps / batch 128
    _, sweep = build_sweep(_args(["--preset", "paper-table1", "--task", "rte", "--seeds", "2"]))
    assert sweep.seeds == 2
    _, sweep = build_sweep(_args(["--preset", "paper-table1"]))  # the pre-training itself: one run a kind
    assert sweep.seeds == 1 and sweep.experiment == "paper-table1"
    assert experiment("paper-table1").run_config("mha").train.steps == 1_000_000
    _, sweep = build_sweep(_args(["--task", "rte"]))
    assert sweep.seeds == 1  # only paper-* presets change the default


def test_five_seed_aggregation_in_a_paper_preset(tmp_path):
    from conftest import require_data

    root = require_data("ptb/ptb.train.txt.gz", "glue/MRPC/dev.tsv.gz")
    pre = tmp_path / "mlm"
    assert main(["compare", "--preset", "cpu-mlm", "--kinds", "mha", "--data", "ptb", "--data-dir", str(root),
                 "--workers", "1", "--out", str(pre), "--set", "train.steps=2", "--set", "data.limit_lines=300",
                 "--set", "data.vocab_size=200", "--set", "model.n_layers=1"]) == 0
    ft = tmp_path / "mrpc"
    assert main(["compare", "--preset", "paper-table1", "--task", "mrpc", "--pretrained", str(pre), "--kinds", "mha",
                 "--data-dir", str(root), "--workers", "1", "--out", str(ft), "--set", "train.steps=1",
                 "--set", "train.batch_size=4", "--set", 'data.task_options={"train_limit": 8, "dev_limit": 12}']) == 0
    s = json.loads((ft / "summary.json").read_text())
    row = s["rows"][0]
    scores = [json.loads((ft / "runs" / f"mha-seed{i}" / "results.json").read_text()) for i in range(5)]
    assert row["n_seeds"] == 5 and s["metric"] == "accuracy"  # MRPC: the paper's accuracy
    assert abs(row["mean"] - sum(r["accuracy"] for r in scores) / 5) <= 1e-12
    assert all(r["official_metrics"] == ["f1", "accuracy"] and 0 <= r["f1"] <= 1 for r in scores)
