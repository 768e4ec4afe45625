"""``benchmarks/train_bench.py llama``'s (``benchmarks/train/llama.py``) arithmetic and stage selection (the GPU run itself is the lead's):
N for MFU leaves out exactly the input embedding lookups, and a group name selects its stages."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from train import llama as llama_speed  # noqa: E402
from mhe.models.config import preset  # noqa: E402


def test_n_leaves_out_the_input_lookups_only():
    llama = preset("llama-1.1b").replace(vocab_size=50_257)  # untied: the input table is a lookup
    assert llama_speed.matmul_params(1_000_000_000, llama) == 1_000_000_000 - 50_257 * 2048
    tied = preset("llama-135m").replace(vocab_size=50_257)  # tied, rotary: the one table is the output layer
    assert llama_speed.matmul_params(135_000_000, tied) == 135_000_000
    gpt2 = preset("gpt2-base")  # tied, learned positions: the position table is a lookup
    assert llama_speed.matmul_params(124_000_000, gpt2) == 124_000_000 - 512 * 768


def test_groups_and_stages_select_the_runs_in_order():
    pick = lambda s: [x.name for x in llama_speed.parse_args(["out", "--stages", s]).selected]  # noqa: E731
    assert pick("llama-135m") == ["l135-mha", "l135-gqa", "l135-mhe-mul", "l135-warm"]
    assert pick("l1b-gqa,gpt2") == ["l1b-gqa", "gpt2-mha", "gpt2-mhe-mul"]
    assert pick("llama-135m-expand") == ["l135-gqa-expand", "l135-mhe-mul-expand"]
    every = llama_speed.parse_args(["out"]).selected
    assert len(every) == 11 and every[0].name == "l135-mha"  # the cold run first
    big = [s for s in llama_speed.stages(False, big_card=False) if s.group == "llama-1.1b"]
    assert all("train.activation_checkpointing=full" in s.sets for s in big)
    assert not any("activation" in v for s in llama_speed.stages(False, big_card=True) for v in s.sets)
    with pytest.raises(SystemExit) as e:
        llama_speed.parse_args(["out", "--stages", "l1b"])
    assert e.value.code == 2


def test_a_one_gpu_stage_runs_on_the_callers_first_visible_gpu(monkeypatch):
    """Scripts started side by side on other GPUs of one host (CUDA_VISIBLE_DEVICES=2) keep to their
    GPU: a stage pinned to GPU 0 regardless put every run on one card, which ran out of memory."""
    from train import runs as train_speed_runs

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert train_speed_runs.first_visible_gpu() == "2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert train_speed_runs.first_visible_gpu() == "0"


def test_the_report_is_written_after_each_stage_and_names_the_stages_not_run(tmp_path):
    """A run stopped from outside after its first stage keeps that stage's row on disk, and the
    report says which stages did not run."""
    from train.runs import Runner

    a = llama_speed.parse_args([str(tmp_path), "--stages", "llama-135m"])
    runner = Runner(tmp_path, "data", 100)
    runner.commands.append("l135-mha: `mhe pretrain ...`")
    llama_speed.report(a, tmp_path, "CPU", runner, {"l135-mha": None})
    text = (tmp_path / "llama-speed.md").read_text()
    assert "Not measured: l135-gqa, l135-mhe-mul, l135-warm." in text
    assert "| l135-mha |" in text and "| l135-gqa |" not in text
    assert json.loads((tmp_path / "llama-speed.json").read_text())["stages"] == {"l135-mha": None}
    assert not list(tmp_path.glob("*.tmp"))
