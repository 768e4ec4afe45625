"""The trainer's DDP step under ``torch.compile`` is one graph (``training/parallelize.py``): dynamo's DDP
optimiser, which splits the graph at the gradient buckets, must never run, because the split
step costs more host time than its overlap saves (docs/benchmarks.md section 7). One gloo
process is enough to build the DDP wrapper; the control case leaves the optimiser on and sees it
run, so the check can fail. Also: ``benchmarks/train_bench.py ddp-setups`` refuses an unknown set-up in
one line with exit status 2, and each of its set-ups takes every argument the trainer passes its step."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.backends import distributed as dynamo_ddp

from mhe.models import build_model
from mhe.training.config import TrainConfig
from mhe.training.distributed import Dist
from mhe.training.parallelize import parallelize

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _splits_seen(monkeypatch) -> list:
    seen = []
    original = dynamo_ddp.DDPOptimizer.compile_fn

    def recording(self, gm, example_inputs, **kw):
        seen.append(len(list(gm.graph.nodes)))
        return original(self, gm, example_inputs, **kw)

    monkeypatch.setattr(dynamo_ddp.DDPOptimizer, "compile_fn", recording)
    return seen


@pytest.mark.slow
@pytest.mark.parametrize("whole", [True, False], ids=["trainer", "split-control"])
def test_compiled_ddp_step_is_one_graph(one_process_group, monkeypatch, whole):
    torch._dynamo.reset()  # no graph compiled by another test (or the other case) is reused
    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention="mhe-mul", d_model=256, d_ff=512, n_layers=2, vocab_size=512)
    step = parallelize(model, TrainConfig(compile=True), Dist(world=2), static_shapes=True,  # world 2: DDP
                       note=lambda _: None).step
    assert isinstance(step.net, torch.nn.parallel.DistributedDataParallel)
    if not whole:  # the control: the same step with dynamo's DDP optimiser left on does split
        step._whole_graph = lambda: torch._dynamo.config.patch(optimize_ddp=True)
    seen = _splits_seen(monkeypatch)
    ids = torch.randint(0, 512, (2, 16))

    def micro_step(net):
        loss = net(ids, labels=ids, return_logits=False).loss
        loss.backward()
        return loss

    loss = step.run(micro_step)
    assert torch.isfinite(loss)
    assert all(p.grad is not None for p in model.parameters())  # the backward reached every weight
    assert (seen == []) if whole else (len(seen) >= 1), seen


def test_ddp_setups_refuses_an_unknown_setup(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "train_bench.py"), "ddp-setups", "fastest",
                        str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "fastest" not in r.stdout and "whole, wrapped-split" in r.stderr and len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("setup", ["whole", "wrapped-split", "inner-split", "blocks"])
def test_ddp_setups_build_the_trainers_step_with_its_arguments(setup, monkeypatch, one_process_group):
    """Each set-up's ``parallelize`` takes every argument the trainer passes and builds the DDP step
    it names (compiled, world 2: the DDP path; nothing is traced until a step runs)."""
    from torch._dynamo.eval_frame import OptimizedModule

    from mhe.training import parallelize as wrapping

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from train import ddp_setups as setups
    monkeypatch.setattr(wrapping, "parallelize", setups._parallelize(setup))
    model = build_model("tiny-decoder", attention="mha")
    ready = wrapping.parallelize(model, TrainConfig(compile=True), Dist(world=2), static_shapes=True, note=print)
    net, ddp = ready.step.net, torch.nn.parallel.DistributedDataParallel
    if setup == "wrapped-split":
        assert isinstance(net, OptimizedModule) and isinstance(net._orig_mod, ddp)
    else:
        assert isinstance(net, ddp)
        assert isinstance(net.module, OptimizedModule) if setup != "blocks" else net.module is model
    assert ready.step.ddp and ready.step.model is model


def test_release_drops_the_ddp_wrapper_while_the_process_group_lives(one_process_group):
    """``StepModule.release`` (the trainer calls it when the steps end, before evaluation and
    teardown) frees DDP's wrapper and its reducer, so they never outlive the process group (a gloo
    group destroyed under a live reducer could hang the process at exit). A weak reference to the
    wrapper dies at release; the steps' module is the plain model after it."""
    import weakref

    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention="mha", d_model=32, d_ff=64, n_layers=1, vocab_size=64)
    step = parallelize(model, TrainConfig(compile=False), Dist(world=2), static_shapes=True,
                       note=lambda _: None).step
    ids = torch.randint(0, 64, (2, 8))
    step.run(lambda net: net(ids, labels=ids, return_logits=False).loss.backward())
    wrapper = weakref.ref(step.net)
    assert isinstance(wrapper(), torch.nn.parallel.DistributedDataParallel)
    step.release()
    assert wrapper() is None and step.net is model
    assert dist.is_initialized()  # freed before teardown, not by it
