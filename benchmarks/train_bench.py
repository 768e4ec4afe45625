"""Training speed and training-time measurements of mhe on real hardware, one subcommand each.

    python benchmarks/train_bench.py SUBCOMMAND [ARGS ...]
    python benchmarks/train_bench.py SUBCOMMAND --help

Each subcommand's module under ``benchmarks/train/`` says what it measures, how long it takes and
where its figures land; they share the runs of ``train/runs.py`` (a logged ``mhe pretrain``
process per stage, under one deadline, and the figures read back from its run folder).
"""

from __future__ import annotations

import sys

from toolbox import run_subcommand

SUBCOMMANDS = {
    "speed": ("train.speed", "`mhe pretrain`'s tokens/s, memory and MFU per preset and kind; one GPU or several"),
    "vs-old": ("train.vs_old", "training speed of this tree beside an older tree's, one card, one run"),
    "llama": ("train.llama", "the Llama presets' training stages on one card (cold and warm compile caches)"),
    "profile": ("train.profile_step", "where a training step's time goes, kernel by kernel (also under torchrun)"),
    "ddp-setups": ("train.ddp_setups", "`profile` with DDP and torch.compile combined each way (under torchrun)"),
    "fsdp": ("train.fsdp", "FSDP against DDP under torchrun, and a model only FSDP can train"),
    "factor-precision": ("train.factor_precision", "MHE-Mul's bf16 loss curve with float32 factors against rounded "
                                                   "ones"),
    "recall-step": ("train.recall_step", "a run of the recall grid timed alone and N at once on one card, eager "
                                         "and compiled"),
}


def main(argv: list[str] | None = None) -> int:
    return run_subcommand("train_bench.py", __doc__.split("\n")[0], SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
