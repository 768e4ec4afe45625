"""The ways to combine DDP with torch.compile that were measured for `mhe pretrain` (issue 27).

    torchrun --standalone --nproc_per_node 2 benchmarks/ddp_setups.py SETUP OUT [profile_train_step.py options]

Runs ``benchmarks/profile_train_step.py`` (every option after ``OUT`` is its own) with the
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
import runpy
import os
import sys
from pathlib import Path

from toolbox import ROOT  # noqa: E402
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=OTHER/src runs another tree
    import toolbox  # noqa: F401  (this checkout's src first)

import torch  # noqa: E402

from mhe.training import parallelize as wrapping  # noqa: E402
from mhe.training.activation_checkpointing import transformer_blocks  # noqa: E402

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


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in SETUPS:
        print(f"usage: ddp_setups.py SETUP OUT [profile_train_step.py options]; SETUP one of {', '.join(SETUPS)}",
              file=sys.stderr)
        raise SystemExit(2)
    wrapping.parallelize = _parallelize(sys.argv[1])
    sys.argv = [str(ROOT / "benchmarks" / "profile_train_step.py")] + sys.argv[2:]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
