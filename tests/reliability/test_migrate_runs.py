"""``benchmarks/results_tools.py migrate`` (``benchmarks/records/migrate.py``): run folders saved by earlier versions (the attention kind beside
model overrides; a sweep.json without its shared settings; checkpoints whose trainer state is
split over seven files) become today's layout and load, train on and resume as they were."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mhe.errors import MheError
from mhe.attention import GroupedQueryOptions
from mhe.tasks import read_run_config, run_config_from_dict
from mhe.tasks.recall import RecallOptions, RecallTask
from mhe.training import checkpoint as ckpt
from mhe.training.atomic import seal_and_place
from mhe.training.loop import Trainer

sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
from records import migrate as migrate_runs  # noqa: E402

# The earlier layout: the kind beside a dict of model overrides, task options as a plain dict.
# That code built its models from the earlier presets (no attention biases, exact GELU): the
# migrated model must be that one, so its hash differs from the one the earlier code computed
# (3fa8d89eab4aaa5d and 393d930d2c6b825a): those preset values are overrides of today's presets.
OLD_RECALL = {"task": "recall", "preset": "tiny-decoder", "attention": "gqa",
              "model": {"d_model": 32, "d_ff": 64, "n_layers": 1, "attn_options": {"n_kv_heads": 2}},
              "train": {"steps": 8, "batch_size": 16, "lr": 0.003, "betas": [0.9, 0.98], "seed": 1, "device": "cpu",
                        "log_every": 1, "save_every": 4, "progress": False, "warmup_steps": 1},
              "data": {"task_options": {"pairs": 4, "queries": 4, "train_size": 128, "test_size": 16}}}
OLD_FINETUNE = {"task": "finetune", "preset": "bert-base", "attention": "el-att", "model": {},
                "train": {"epochs": 5, "lr": 0.0001, "schedule": "cosine_restarts", "warmup_ratio": 0.06,
                          "betas": [0.9, 0.999], "eps": 1e-06, "weight_decay": 0.0, "patience": 3},
                "data": {"dataset": "cb", "data_dir": "data-cache",
                         "task_options": {"task": "cb", "checkpoint": "results/encoder-mlm/runs/el-att-seed0"}}}


@pytest.mark.parametrize("old", [OLD_RECALL, OLD_FINETUNE])
def test_an_old_run_migrates_to_the_model_it_built_and_round_trips(old):
    new = migrate_runs.migrate_run(json.loads(json.dumps(old)), "test")
    cfg = run_config_from_dict(new, source="test")
    assert (cfg.model.attn_bias, cfg.model.activation) == (False, "gelu")  # the earlier presets
    assert cfg.model_overrides()["attn_bias"] is False and cfg.model.attention == old["attention"]
    assert "attention" not in new and new["model"]["attention"] == old["attention"]
    digest = cfg.hash()
    again = run_config_from_dict(json.loads(json.dumps(cfg.to_dict())), source="test")
    assert again.hash() == digest and again.to_dict() == cfg.to_dict()
    with pytest.raises(MheError, match="earlier layout"):
        run_config_from_dict(old, source="test")  # unmigrated: refused


def test_migrated_values_are_typed():
    cfg = run_config_from_dict(migrate_runs.migrate_run(OLD_RECALL, "test"), source="test")
    assert cfg.model.attn_options == GroupedQueryOptions(n_kv_heads=2) and cfg.model.n_layers == 1
    assert cfg.data.task_options == RecallOptions(pairs=4, queries=4, train_size=128, test_size=16)
    assert cfg.train.betas == (0.9, 0.98)


def _seven_files(point: Path) -> None:
    """Rewrite a checkpoint's trainer state in the earlier seven-file layout, sealed."""
    state = ckpt.read_trainer_state(point)
    opt = state.pop("optimizer")
    tensors, meta = {}, {"param_groups": opt["param_groups"], "state": {}}
    for idx, slots in opt["state"].items():
        meta["state"][str(idx)] = {k: v for k, v in slots.items() if not torch.is_tensor(v)}
        tensors.update({f"{idx}/{k}": v for k, v in slots.items() if torch.is_tensor(v)})
    old = point.parent / "old"
    old.mkdir()
    shutil.copyfile(point / "model.safetensors", old / "model.safetensors")
    save_file(tensors, str(old / "optimizer.safetensors"))
    (old / "optimizer.json").write_text(json.dumps(meta))
    rng = state.pop("rng")
    save_file(rng["tensors"], str(old / "rng.safetensors"))
    (old / "rng.json").write_text(json.dumps(rng["meta"]))
    (old / "scheduler.json").write_text(json.dumps(state.pop("scheduler")))
    (old / "trainer.json").write_text(json.dumps(state))
    seal_and_place(old, point)


def test_a_folder_of_the_earlier_layout_migrates_and_resumes(tmp_path):
    """An interrupted run whose config.json and checkpoint are in the earlier layouts: refused
    until migrated, then it resumes from that checkpoint and ends as a straight run does."""
    new = run_config_from_dict(migrate_runs.migrate_run(OLD_RECALL, "test"), source="test")
    straight = Trainer(new, RecallTask(), tmp_path / "straight", log=lambda *_: None).fit()
    run = tmp_path / "cmp" / "runs" / "gqa-seed0"
    stopped = run_config_from_dict(migrate_runs.migrate_run(OLD_RECALL, "test"), source="test")
    stopped.train.stop_at = 4
    Trainer(stopped, RecallTask(), run, log=lambda *_: None).fit()
    record = json.loads((run / "config.json").read_text())
    record["run"] = OLD_RECALL  # as the earlier version wrote it
    (run / "config.json").write_text(json.dumps(record))
    (run / "run.json").write_text(json.dumps(OLD_RECALL))
    (tmp_path / "cmp" / "sweep.json").write_text(json.dumps({"sweep": {"task": "recall", "kinds": ["gqa"]}}))
    _seven_files(ckpt.list_checkpoints(run / "checkpoints")[-1])
    with pytest.raises(MheError, match=r"convert it with: python benchmarks/results_tools.py migrate"):
        read_run_config(run)

    assert migrate_runs.main([str(tmp_path / "cmp")]) == 0
    assert migrate_runs.migrate(tmp_path / "cmp") == []  # a second pass changes nothing
    assert read_run_config(run).hash() == new.hash()
    shared = json.loads((tmp_path / "cmp" / "sweep.json").read_text())["sweep"]["run"]
    assert "attention" not in shared and shared["model"]["attn_bias"] is False
    messages = []
    res = Trainer(new, RecallTask(), run, resume=True, log=messages.append).fit()
    assert any("resuming from" in m and "step-00000004" in m for m in messages), messages
    assert res["step"] == 8 and res["score"] == straight["score"]


def _write_hash(run: Path, digest: str) -> None:
    """Give a run folder's records and checkpoints the configuration hash ``digest``."""
    for name in ("config.json", "results.json"):
        if (run / name).is_file():
            record = json.loads((run / name).read_text())
            (run / name).write_text(json.dumps({**record, "config_hash": digest}))
    for point in ckpt.list_checkpoints(run / "checkpoints"):
        ckpt.rewrite_trainer_state(point, {**ckpt.read_trainer_state(point), "config_hash": digest})


def test_hashes_of_the_earlier_identity_layout_are_rewritten_and_the_run_resumes(tmp_path):
    """A stopped run whose records and checkpoint carry the hash of the earlier identity layout:
    the trainer does not resume from that checkpoint; migrated, every hash is today's and the run
    resumes from it and ends as a straight run does. A checkpoint of another configuration keeps
    its hash."""
    cfg = run_config_from_dict(migrate_runs.migrate_run(OLD_RECALL, "test"), source="test")
    done = tmp_path / "runs" / "finished"
    straight = Trainer(cfg, RecallTask(), done, log=lambda *_: None).fit()
    legacy = migrate_runs.legacy_hash(cfg)
    assert legacy != cfg.hash() and "attention" in migrate_runs.legacy_identity(cfg)
    run, foreign = tmp_path / "runs" / "gqa-seed0", tmp_path / "runs" / "gqa-seed1"
    stopped = run_config_from_dict(migrate_runs.migrate_run(OLD_RECALL, "test"), source="test")
    stopped.train.stop_at = 4
    Trainer(stopped, RecallTask(), run, log=lambda *_: None).fit()
    _write_hash(run, legacy)
    _write_hash(done, legacy)
    for copy in (tmp_path / "unmigrated", foreign):
        shutil.copytree(run, copy)
    point = ckpt.list_checkpoints(foreign / "checkpoints")[-1]
    ckpt.rewrite_trainer_state(point, {**ckpt.read_trainer_state(point), "config_hash": "0123456789abcdef"})
    said = []
    Trainer(cfg, RecallTask(), tmp_path / "unmigrated", resume=True, log=said.append).fit()
    assert not any("resuming from" in m for m in said), said  # the earlier layout's hash is not this run's
    assert any("python benchmarks/results_tools.py migrate RUN_FOLDER gives it today's hash" in m for m in said), said

    changed = migrate_runs.migrate(tmp_path / "runs")
    assert {run / "config.json", done / "results.json", foreign / "config.json"} <= set(changed)
    assert json.loads((done / "results.json").read_text())["config_hash"] == cfg.hash()
    assert migrate_runs.migrate(tmp_path / "runs") == []
    assert json.loads((run / "config.json").read_text())["config_hash"] == cfg.hash()
    assert ckpt.read_trainer_state(ckpt.list_checkpoints(run / "checkpoints")[-1])["config_hash"] == cfg.hash()
    assert ckpt.read_trainer_state(point)["config_hash"] == "0123456789abcdef"
    said = []
    res = Trainer(cfg, RecallTask(), run, resume=True, log=said.append).fit()
    assert any("resuming from" in m and "step-00000004" in m for m in said), said
    assert res["step"] == 8 and res["score"] == straight["score"]
