"""``train.grad_reduce``: DDP's gradient all-reduce in float32 (the default) or in bf16 (torch's
``bf16_compress_hook``, registered by ``mhe.training.parallelize.data_parallel``).

Two gloo processes on a CPU run one forward and backward pass of a tiny model through
:func:`~mhe.training.parallelize.parallelize`'s step module on different batches. In float32 the reduced gradients
are the mean of the two processes' own gradients (halving by two is exact, so only the sum's
rounding differs). In bf16 every reduced gradient is a bf16 value (the hook casts the bucket to
bf16 for the wire and back): a hook that was not registered leaves float32 values, most of which
bf16 cannot hold, and the result would equal the float32 one bit for bit. The bf16 mean stays
within bf16 rounding of the float32 mean.

DDP refuses ``bf16_compress_hook`` by its name unless torch was built with CUDA and NCCL (a check
of the build, not of the backend: gloo all-reduces bf16 tensors on a CPU), so the ``bf16`` case
lifts that one check in the worker processes to run the real hook over gloo (and so does the
``float32`` case, where a hook registered regardless of the setting would show); the ``bf16-cpu``
case keeps it and must see the trainer's note and float32 gradients (on a CUDA build of torch it
registers the hook like ``bf16``). One process: the setting is noted as having no effect; under
FSDP it is refused in one line; the default keeps the hashes of saved runs.
"""

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from processes import spawn_on_a_free_port
from mhe.errors import MheError
from mhe.experiments.run_archive import RunFiles
from mhe.models import build_model
from mhe.tasks import default_run, run_config_from_dict
from mhe.tasks.recall import RecallTask
from mhe.training.config import TrainConfig, apply_overrides
from mhe.training.distributed import Dist
from mhe.training.loop import Trainer
from mhe.training.parallelize import parallelize

VOCAB = 64
SAVED = Path(__file__).parents[2] / "results" / "decoder-lm"  # its runs packed in runs.tar.xz


def tiny_model() -> torch.nn.Module:
    """The same weights in every process and every mode."""
    torch.manual_seed(0)
    return build_model("tiny-decoder", attention="mha", vocab_size=VOCAB, d_model=32, n_heads=4, d_ff=64,
                       n_layers=1, dropout=0.0, attn_dropout=0.0)


def gradients(rank: int, world: int, mode: str, notes: list[str]) -> dict[str, torch.Tensor]:
    """One backward pass on this rank's batch: ``local`` without DDP, else through the trainer's
    DDP module with ``grad_reduce=mode`` (``bf16-cpu``: bf16 with torch's build check kept)."""
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(10 + rank))

    def micro_step(net):
        net(ids, labels=ids, return_logits=False).loss.backward()

    if mode == "local":
        micro_step(model)
    else:
        checked = torch.nn.parallel.DistributedDataParallel._check_comm_hook
        if mode != "bf16-cpu":  # the build check only: the hook itself runs as on CUDA
            torch.nn.parallel.DistributedDataParallel._check_comm_hook = lambda self, hook: None
        try:
            t = TrainConfig(compile=False, grad_reduce=mode.removesuffix("-cpu"))
            step = parallelize(model, t, Dist(rank=rank, world=world, local_rank=rank), static_shapes=True,
                               note=notes.append).step
        finally:
            torch.nn.parallel.DistributedDataParallel._check_comm_hook = checked
        step.run(micro_step)
    return {k: p.grad.detach().clone() for k, p in model.named_parameters()}


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        notes: list[str] = []
        found = {mode: gradients(rank, world, mode, notes) for mode in ("local", "float32", "bf16", "bf16-cpu")}
        torch.save({**found, "notes": notes}, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("grad_reduce")
    spawn_on_a_free_port(_worker, lambda port: (2, port, str(out)))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


def test_float32_reduce_is_the_mean_of_the_processes_gradients(reduced):
    a, b = reduced
    assert any(not torch.equal(a["local"][k], b["local"][k]) for k in a["local"])  # the batches differ
    for k in a["local"]:
        mean = (a["local"][k] + b["local"][k]) / 2
        torch.testing.assert_close(a["float32"][k], mean, rtol=1e-6, atol=1e-8, msg=lambda m, n=k: f"{n}: {m}")
        assert torch.equal(a["float32"][k], b["float32"][k]), k  # every process holds the same average


def test_bf16_reduce_sends_bf16_and_stays_within_its_rounding_of_the_mean(reduced):
    a, b = reduced
    differs = 0
    for k in a["local"]:
        g, g32 = a["bf16"][k], a["float32"][k]
        assert g.dtype == torch.float32 and torch.equal(g, b["bf16"][k]), k  # cast back; the same on every process
        assert torch.equal(g.bfloat16().float(), g), f"{k}: not a bf16 value: the hook did not run"
        scale = (a["local"][k].abs() + b["local"][k].abs()) / 2  # the cast's error is relative to each input
        assert ((g - g32).abs() <= 2 ** -7 * (scale + g32.abs()) + 1e-30).all(), k
        differs += not torch.equal(g, g32)
    assert differs > len(a["local"]) // 2, differs  # most tensors carry the rounding


def test_without_cuda_torch_refuses_the_hook_and_the_step_notes_it_and_reduces_in_float32(reduced):
    a, b = reduced
    if torch.version.cuda is not None:
        pytest.skip("a CUDA build of torch accepts the hook")
    assert len(a["notes"]) == 1 and a["notes"][0].startswith("train.grad_reduce=bf16 has no effect here (BF16 all "
                                                             "reduce communication hook required CUDA"), a["notes"]
    assert "\n" not in a["notes"][0] and b["notes"] == a["notes"]  # one line, on every process (the trainer shows rank 0's)
    for k in a["local"]:
        assert torch.equal(a["bf16-cpu"][k], a["float32"][k]), k


def test_one_process_notes_that_bf16_reduce_has_no_effect(tmp_path):
    """The trainer passes the setting to its step module (a plain module on one process)."""
    cfg = apply_overrides(default_run("recall", "tiny-decoder", "mha"),
                          ["train.grad_reduce=bf16", "train.device=cpu", "train.steps=1", "train.progress=false",
                           "train.batch_size=8",
                           "model.d_model=32", "model.d_ff=64", "model.n_layers=1",
                           'data.task_options={"train_size": 32, "test_size": 8}'])
    said = []
    Trainer(cfg, RecallTask(), tmp_path / "run", log=said.append).fit()
    assert any(line.startswith("train.grad_reduce=bf16 has no effect here") for line in said), said


def test_bf16_reduce_is_refused_under_fsdp_and_is_part_of_the_run():
    with pytest.raises(MheError, match=r"^train.grad_reduce='bf16' is not allowed with train.parallel=fsdp .*; "
                                       r"train.grad_reduce takes float32 there"):
        apply_overrides(default_run("lm", "tiny-decoder", "mha"), ["train.parallel=fsdp", "train.grad_reduce=bf16"])
    base = default_run("lm", "tiny-decoder", "mha")
    assert base.identity()["train"]["grad_reduce"] == "float32"
    assert apply_overrides(default_run("lm", "tiny-decoder", "mha"), ["train.grad_reduce=bf16"]).hash() != base.hash()
    if SAVED.exists():  # a committed run (migrated by benchmarks/results_tools.py migrate) keeps its hash
        saved = RunFiles(SAVED).config("mha-seed0")
        assert run_config_from_dict(saved["run"], source=str(SAVED)).hash() == saved["config_hash"]
