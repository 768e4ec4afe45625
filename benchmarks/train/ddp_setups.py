"""The ways to combine DDP with torch.compile that were measured for `mhe pretrain` (issue 27).

    torchrun --standalone --nproc_per_node 2 benchmarks/train_bench.py ddp-setups SETUP OUT [profile options]

Runs ``benchmarks/train_bench.py profile`` (every option after ``OUT`` is its own) with the
trainer's step module (:func:`~mhe.training.parallelize.parallelize`) built one of these ways:

* ``whole`` (the trainer's default): the model compiled whole, then wrapped by DDP; dynamo's DDP
  optimiser off while a step runs, so the step is one graph and the gradient buckets are reduced
  after the backward pass;
* ``wrapped-split`` (the default before): DDP wraps the model and the wrapper is compiled;
  dynamo's DDP optimiser splits the graph at the gradient buckets so that each bucket's
  all-reduce overlaps the backward pass (dynamo also breaks the graph in DDP's own forward);
* ``wrapped-whole``: the same with the DDP optimiser off (one graph, the breaks in DDP's forward kept);
* ``inner-split``: the compiled model wrapped by DDP with the DDP optimiser on (it still splits:
  dynamo sees the DDP module that is running);
* ``blocks``: each transformer block compiled on its own (as under FSDP), DDP outside.

On two H100s (gpt2-base, 16 rows per GPU; docs/benchmarks.md section 7) ``whole`` ran at 27.4 ms
per step against 55.0 for ``wrapped-split``: the step is bound by the host's time to queue its
kernels, and splitting costs more host time than overlapping the all-reduce saves. That was
before the step was replayed as CUDA graphs; every set-up but ``blocks`` now compiles as the
trainer decides (``--cuda-graphs auto``, the default: graphs on CUDA; ``false``: launched kernel
by kernel, as measured then), so ``inner-split`` against ``whole`` asks again whether the
overlap pays once the host's time is gone.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from mhe.training import parallelize as wrapping
from mhe.training.activation_checkpointing import transformer_blocks

SETUPS = ("whole", "wrapped-split", "wrapped-whole", "inner-split", "blocks")
_trainers_parallelize = wrapping.parallelize


def _ddp(module, dist):
    ids = [dist.local_rank] if dist.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids, gradient_as_bucket_view=True)


def _parallelize(setup: str):
    """``parallelize`` building the DDP step as ``setup`` says (the trainer's own for ``whole``): the
    trainer's, then, for a compiled DDP step, its module rebuilt from the model (the trainer's DDP
    wrapper is dropped, as its hooks go with it)."""

    def parallelize(model, t, dist, *, static_shapes, note):
        ready = _trainers_parallelize(model, t, dist, static_shapes=static_shapes, note=note)
        step = ready.step
        if setup == "whole" or not (step.ddp and step.compiled):
            return ready
        if setup == "blocks":
            step.cuda_graphs = False  # the graphs are the whole step's; blocks compile one by one
            for block in transformer_blocks(model):
                block.forward = torch.compile(block.forward)
            step.net = _ddp(model, dist)
        elif setup == "inner-split":
            step.net = _ddp(wrapping.compile_model(model, step.cuda_graphs), dist)
        else:  # wrapped-*: DDP first, then the wrapper compiled
            step.net = wrapping.compile_model(_ddp(model, dist), step.cuda_graphs)
        split = setup.endswith("split")
        step._whole_graph = (lambda: contextlib.nullcontext()) if split else \
            (lambda: torch._dynamo.config.patch(optimize_ddp=False))
        step.proven = True
        return ready

    return parallelize


def main(argv: list[str]) -> int:
    """``SETUP OUT [profile options]``: ``train_bench.py profile OUT ...`` with the step built as ``SETUP``."""
    usage = (f"usage: train_bench.py ddp-setups SETUP OUT [train_bench.py profile options]; SETUP one of "
             f"{', '.join(SETUPS)}")
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{usage}\n\n{__doc__}")
        return 0
    if len(argv) < 2 or argv[0] not in SETUPS:
        print(usage, file=sys.stderr)
        return 2
    from train import profile_step

    wrapping.parallelize = _parallelize(argv[0])
    return profile_step.main(argv[1:])
