"""FSDP through the project's own trainer: two CPU processes (gloo) that shard the model train like
one process at the full batch, save checkpoints a single process would write, stop together on a
signal that reached one of them, and resume exactly, on two processes or on one.

As in tests/training/test_ddp.py, only floating-point summation order may differ from one process
(gradients reduce-scattered and averaged, the gradient norm summed shard by shard), so losses,
gradient norms and weights agree to float32 rounding. The FSDP side also pads its vocabulary
(as every GPU run does; here through the task, the trainer pads only on CUDA), so the padding's
state-dict hooks are crossed with the sharded state: checkpoints must still hold the real rows.
A resumed run repeats the same operations on the same numbers: its losses are identical. One
run compiles each block (dynamo and AOT autograd with the aot_eager backend: the traced graphs
run without inductor's C++ build, minutes on a CPU) under FSDP's hooks and activation
checkpointing; bf16 gathers are the GPU's (tests/training/test_fsdp_gpu.py).
"""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from processes import as_torchrun_would, spawn_on_a_free_port
from test_ddp import RUN, STEPS, final_weights, records
from mhe.models.vocab_padding import pad_vocabulary, vocab_padding
from mhe.tasks.recall import RecallTask
from mhe.tasks.runs import load_run
from mhe.training import checkpoint as ckpt
from mhe.training.config import apply_overrides
from mhe.tasks import default_run
from mhe.training.loop import Trainer

STOP = 3  # the step the interrupted run saves
# The GPU's defaults where torch allows them on a CPU: bf16 gathers and compute with float32
# gradient reduction (the policy FSDP's input casting applies to every block), each block compiled.
MIXED = ("train.precision=bf16", "train.compile=true", "train.activation_checkpointing=selective")


class PaddedRecall(RecallTask):
    """Recall whose model comes with a padded vocabulary; on rank 0 of an interrupted run, a
    SIGTERM arrives while step ``STOP``'s batch is built (rank 1 receives none)."""

    def __init__(self, interrupt: bool = False) -> None:
        self.interrupt, self.calls = interrupt, 0

    def setup(self, cfg, out, dist):
        model = super().setup(cfg, out, dist)
        pad_vocabulary(model)
        assert vocab_padding(model) > 0
        return model

    def collate(self, indices):
        self.calls += 1
        if self.interrupt and self.calls == STOP:
            os.kill(os.getpid(), signal.SIGTERM)
        return super().collate(indices)


def config(*extra):
    return apply_overrides(default_run("recall", "tiny-decoder", "mhe-mul"), RUN + list(extra))


def _worker(rank: int, world: int, port: int, out: str, extra: list, interrupt: bool, resume: bool) -> None:
    as_torchrun_would(rank, world, port)
    if "train.compile=true" in extra:  # dynamo and AOT autograd for real, without inductor's C++ build
        compile_ = torch.compile
        torch.compile = lambda fn, **kw: compile_(fn, backend="aot_eager", **kw)
    task = PaddedRecall(interrupt=interrupt and rank == 0)
    built, init = [], torch.optim.AdamW.__init__
    torch.optim.AdamW.__init__ = lambda self, *a, **kw: (built.append(1), init(self, *a, **kw))[1]
    Trainer(config("train.parallel=fsdp", *extra), task, out, resume=resume, log=lambda *_: None).fit()
    (Path(out) / f"optimisers-built-rank{rank}.txt").write_text(str(len(built)))  # once, on the shards
    if "train.compile=true" in extra and rank == 0 and not resume:
        from torch._dynamo.utils import counters
        (Path(out) / "graphs.json").write_text(json.dumps(counters["stats"]["unique_graphs"]))


def fsdp(out, *extra, interrupt=False, resume=False):
    spawn_on_a_free_port(_worker, lambda port: (2, port, str(out), list(extra), interrupt, resume))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """one: one process, full batch; whole: FSDP, 6 steps, selective activation checkpointing;
    compiled: FSDP with each block compiled (dynamo, aot_eager) and fully checkpointed; mixed: the
    GPU's mixed precision and per-block compile, once whole and once stopped and resumed; resumed:
    FSDP stopped by a signal at step 3, then resumed on two processes; moved: the same checkpoint
    resumed on one process."""
    root = tmp_path_factory.mktemp("fsdp")
    Trainer(config(), RecallTask(), root / "one", log=lambda *_: None).fit()
    fsdp(root / "whole", "train.activation_checkpointing=selective")
    fsdp(root / "compiled", "train.compile=true", "train.activation_checkpointing=full")
    fsdp(root / "mixed", *MIXED)
    fsdp(root / "mixed-stopped", *MIXED, f"train.stop_at={STOP}")
    fsdp(root / "mixed-stopped", *MIXED, resume=True)
    fsdp(root / "resumed", interrupt=True)
    stopped = {p.name for p in ckpt.list_checkpoints(root / "resumed" / "checkpoints")}
    shutil.copytree(root / "resumed", root / "moved")
    fsdp(root / "resumed", resume=True)
    Trainer(config(), RecallTask(), root / "moved", resume=True, log=lambda *_: None).fit()
    return root, stopped


@pytest.mark.slow
def test_fsdp_at_half_batch_per_process_equals_one_process_at_full_batch(runs):
    root, _ = runs
    a, b = records(root / "one"), records(root / "whole")
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-6)  # averaged, not summed
    assert a[-1]["loss"] < a[0]["loss"]
    for run in ("whole", "resumed"):  # the optimiser is built once, after sharding (resumed: loaded into it)
        assert [(root / run / f"optimisers-built-rank{r}.txt").read_text() for r in (0, 1)] == ["1", "1"], run
    wa, wb = final_weights(root / "one"), final_weights(root / "whole")
    assert wa.keys() == wb.keys()
    for name in wa:  # the gathered weights, real vocabulary rows only
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    oa, ob = ({k: v for k, v in load_file(str(r / "checkpoints" / f"step-{STEPS:08d}" / ckpt.STATE_TENSORS)).items()
               if k.startswith("optimizer")} for r in (root / "one", root / "whole"))
    assert oa
    assert oa.keys() == ob.keys()  # one process's layout, index for index: the moments gathered, padding cut
    for name in oa:
        torch.testing.assert_close(ob[name], oa[name], rtol=1e-4, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}")
    ra, rb = (json.loads((r / "results.json").read_text()) for r in (root / "one", root / "whole"))
    assert rb["score"] == pytest.approx(ra["score"])
    assert rb["total_params"] == ra["total_params"]  # tied weights stay tied in the gathered copy
    model, cfg, _ = load_run(root / "whole")  # what mhe eval / generate / convert read: an ordinary run folder
    assert cfg.train.parallel == "fsdp"
    for name, value in model.state_dict().items():
        assert torch.equal(value, wb[name]), name


@pytest.mark.slow
def test_each_block_compiled_under_fsdp_trains_as_eager_fsdp(runs):
    """torch.compile traces each sharded block between FSDP's gather and free hooks (and through
    the activation checkpoint): the same losses and weights as the eager run."""
    root, _ = runs
    assert json.loads((root / "compiled" / "graphs.json").read_text()) >= 1  # compiled, not eager
    a, b = records(root / "whole"), records(root / "compiled")
    assert [r["step"] for r in b] == list(range(1, STEPS + 1))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-6)
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-6)
    wa, wb = final_weights(root / "whole"), final_weights(root / "compiled")
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.slow
def test_a_signal_on_one_process_stops_both_and_the_resumed_run_repeats_the_uninterrupted_one(runs):
    root, stopped = runs
    assert stopped == {f"step-{STOP:08d}"}  # both stopped after the same step and saved it together
    whole, resumed = records(root / "whole"), records(root / "resumed")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for rw, rr in zip(whole, resumed):  # also: selective checkpointing (whole) changed nothing
        assert (rr["loss"], rr["grad_norm"]) == (rw["loss"], rw["grad_norm"]), rr["step"]
    ww, wr = final_weights(root / "whole"), final_weights(root / "resumed")
    for name in ww:
        assert torch.equal(wr[name], ww[name]), name


@pytest.mark.slow
def test_an_fsdp_checkpoint_resumes_on_one_process(runs):
    root, _ = runs
    one, moved = records(root / "one"), records(root / "moved")
    assert [r["step"] for r in moved] == list(range(1, STEPS + 1))
    for ra, rm in zip(one[STOP:], moved[STOP:]):
        assert rm["loss"] == pytest.approx(ra["loss"], rel=1e-6)
    wa, wm = final_weights(root / "one"), final_weights(root / "moved")
    for name in wa:
        torch.testing.assert_close(wm[name], wa[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _broken_compile_worker(rank: int, world: int, port: int, out: str) -> None:
    as_torchrun_would(rank, world, port)

    def broken(fn, **kw):
        def run(*a, **k):
            raise RuntimeError("no working C compiler\nsecond line")
        return run

    torch.compile = broken  # this process only
    Trainer(config("train.parallel=fsdp", "train.compile=true"), RecallTask(), out, log=lambda *_: None).fit()


@pytest.mark.slow
def test_a_compile_failure_under_fsdp_is_one_line_naming_the_way_out(tmp_path):
    """Under FSDP a pass cut short cannot be retried eagerly (the shards' gather state stays
    behind): the run stops with one line instead of training on wrong gradients."""
    with pytest.raises(mp.ProcessRaisedException, match=r"MheError: torch.compile cannot compile this configuration "
                       r"under FSDP \(RuntimeError: no working C compiler\); set train.compile=false"):
        spawn_on_a_free_port(_broken_compile_worker, lambda port: (2, port, str(tmp_path / "run")))


@pytest.mark.slow
def test_fsdp_with_the_gpus_mixed_precision_and_compile_trains_and_resumes_exactly(runs):
    """bf16 gathers make FSDP cast every block's inputs (masks included) to bf16, the path a GPU
    run takes and a float32 CPU run never did; the run trains as the float32 one does, to bf16's
    tolerance, and a stopped run resumed on two processes repeats the uninterrupted one."""
    root, _ = runs
    assert json.loads((root / "mixed" / "graphs.json").read_text()) >= 1  # compiled, not eager
    full, mixed, resumed = records(root / "whole"), records(root / "mixed"), records(root / "mixed-stopped")
    assert [r["step"] for r in mixed] == [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for rf, rm in zip(full, mixed):
        assert rm["loss"] == pytest.approx(rf["loss"], rel=2e-2)
        assert rm["loss"] != rf["loss"]  # computed in bf16, not float32
    for rm, rr in zip(mixed, resumed):
        assert (rr["loss"], rr["grad_norm"]) == (rm["loss"], rm["grad_norm"]), rr["step"]
    wm, wr = final_weights(root / "mixed"), final_weights(root / "mixed-stopped")
    for name in wm:
        assert wm[name].dtype == torch.float32  # the sharded weights the optimiser updates stay float32
        assert torch.equal(wr[name], wm[name]), name
