"""FSDP with the GPU defaults (run with ``pytest -m gpu`` on a host with two CUDA devices): two NCCL
processes, each block compiled, bf16 gathers with float32 gradient reduction, the vocabulary
padded (99 -> 128), fused AdamW, batches prefetched, activation checkpointing on.

FSDP trains like DDP (bf16 either way, so to bf16's tolerance, as tests/training/test_gpu.py compares the
compiled and eager steps), a stop and resume gives the same losses up to the GPU's
non-deterministic reductions (bit-exact resume: tests/training/test_fsdp.py on the CPU), the checkpoint
holds the real vocabulary, and it resumes on one GPU.
"""

import os
import shutil

import pytest
import torch

from processes import spawn_on_a_free_port

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA devices")
SMALL = ["model.d_model=64", "model.d_ff=128", "model.n_layers=2", "model.dropout=0", "model.attn_dropout=0",
         'data.task_options={"train_size": 256, "test_size": 64, "pairs": 4, "queries": 4, "n_keys": 48, '
         '"n_values": 50}', "train.batch_size=16", "train.steps=12", "train.log_every=3", "train.save_every=6",
         "train.progress=false", "train.device=cuda", "train.warmup_steps=2"]


def _train(out: str, extra: list, resume: bool) -> None:
    from mhe.tasks.recall import RecallTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.loop import Trainer

    cfg = apply_overrides(default_run("recall", "tiny-decoder", "mhe-mul"), SMALL + list(extra))
    Trainer(cfg, RecallTask(), out, resume=resume, log=lambda *_: None).fit()


def _worker(rank: int, port: int, out: str, extra: list, resume: bool) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    _train(out, extra, resume)


def two(out, *extra, resume=False):
    spawn_on_a_free_port(_worker, lambda port: (port, str(out), list(extra), resume))


def losses(out):
    from mhe.training.run_files import read_metrics

    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


@pytest.mark.two_gpus
@two_gpus
def test_fsdp_with_the_gpu_defaults_trains_like_ddp_resumes_and_saves_the_real_vocabulary(tmp_path):
    from safetensors.torch import load_file

    fsdp = ["train.parallel=fsdp", "train.activation_checkpointing=selective"]
    two(tmp_path / "ddp")
    two(tmp_path / "fsdp", *fsdp)
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(tmp_path / "ddp"), rel=2e-2)
    assert losses(tmp_path / "fsdp")[-1] < losses(tmp_path / "fsdp")[0]
    two(tmp_path / "stopped", *fsdp, "train.stop_at=6")
    shutil.copytree(tmp_path / "stopped", tmp_path / "one")
    two(tmp_path / "stopped", *fsdp, resume=True)
    assert losses(tmp_path / "stopped") == pytest.approx(losses(tmp_path / "fsdp"), rel=1e-3)
    weights = load_file(str(tmp_path / "fsdp" / "checkpoints" / "step-00000012" / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (99, 64)  # gathered, padding cut
    _train(str(tmp_path / "one"), [], resume=True)  # an FSDP checkpoint resumed on one GPU (no FSDP)
    assert losses(tmp_path / "one") == pytest.approx(losses(tmp_path / "fsdp"), rel=2e-2)
    for run in ("stopped", "one"):  # both resumed at step 6: none set aside (a restart repeats the losses)
        assert not list((tmp_path / run / "checkpoints").glob("*.rejected-*")), run
