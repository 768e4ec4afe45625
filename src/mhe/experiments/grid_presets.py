"""Grid presets (:mod:`mhe.experiments.grid`): recall at Zoology's scale (issue 60).

Zoology's MQAR figure (Arora et al. 2023, figure 2; its repository's configurations): decoders
of 2 layers at widths 64, 128, 256 and 512; sequence lengths 64, 128, 256 and 512 with 4, 8, 16
and 64 key-value pairs, every pair queried, queries at power-law distances (``power_a`` 0.01),
padding between them; a vocabulary of 8,192 (keys from one half, values from the other);
100,000 training and 3,000 test sequences; learning rates 1e-4 to 1e-2 (4 of them), 64 epochs.

Ours: the same cells, widths, vocabulary and layout, 100,000 training and 1,000 test sequences
per cell; every kind in a GPT-2 block (learned positions, LayerNorm, GELU), MHE-Mul in both rotary
orders and MHA beside them in a Llama-style block (RMSNorm, SwiGLU, rotary positions); heads of
16 at width 64 (4 heads), up to heads of 64 from width 256 (``max(4, width // 64)`` heads); GQA
keeps half the heads as K/V heads; no dropout. Each kind at its best of three learning rates
(seed 0), then 3 seeds at that rate. The schedule is far shorter than Zoology's 64 epochs:
:data:`RECALL_STEPS` per length with :data:`RECALL_BATCH` sequences a step, 10% warm-up, cosine; the same for every
kind, so the figure compares kinds trained alike on a budget, not at convergence. The full-length
study is the same command with ``--set train.steps=N`` (or ``train.epochs``).

Calibration on a CPU (MHA, length 64, 4 pairs, width 64 as 4 heads of 16, lr 3e-3, a 2000-step
schedule, batch 64): test accuracy 0.146, 0.211, 0.226 and 0.230 at steps 250, 500, 1000 and 1500.
At this vocabulary MHA is far from Zoology's near 100% within these budgets (Zoology's attention
has one head of 64 at width 64 and about 12,500 steps of 512 sequences); the budgeted grid measures
early training. A smaller vocabulary is ``--set data.task_options.n_keys=K --set
data.task_options.n_values=V`` (the overrides follow the preset's settings).
"""

from __future__ import annotations

import functools

from mhe.experiments.grid import Block, Grid, kv_heads
from mhe.tasks.settings import RecallOptions
from mhe.training.config import RunConfig

ZOOLOGY_CELLS = ((64, 4), (128, 8), (256, 16), (512, 64))
ZOOLOGY_WIDTHS = (64, 128, 256, 512)
ZOOLOGY_VOCAB = 8192  # [PAD] + 4,095 keys + 4,096 values
RECALL_KINDS = ("mha", "gqa", "mqa", "sha", "mhe-add", "mhe-mul", "el-att", "skv")
ROTARY_ENTRIES = ("mha", "mhe-mul rope-then-psi", "mhe-mul psi-then-rope")
RECALL_STEPS = {64: 300, 128: 400, 256: 500, 512: 600}
"""Steps per sequence length of ``gpu-recall-zoology``: sized to the device time a session has
(about 11 minutes of one H200 for the 880 runs, estimated: ``results/recall-zoology/RUN.md``), not
to convergence."""
RECALL_BATCH = {64: 64, 128: 64, 256: 32, 512: 16}
"""Sequences per step by length: 4k tokens a step at length 64, 8k from 128 on (Zoology also
shrinks its batch as sequences grow); queried values a step: 256, 512, 512 and 1,024."""


def heads_of(width: int) -> int:
    """Heads at a width: 4 up to width 256 (heads of 16, 32, 64), then heads of 64."""
    return max(4, width // 64)


def swiglu_width(width: int) -> int:
    """The Llama block's SwiGLU width: 8/3 of the model width, rounded up to a multiple of 64."""
    return 64 * -(-8 * width // (3 * 64))


def recall_zoology(cfg: RunConfig, length: int, pairs: int, width: int, *, steps: dict, batch: dict,
                   train_size: int = 100_000, test_size: int = 1000) -> RunConfig:
    """One cell and width of the recall grid (see the module's docstring)."""
    rotary = cfg.model.positions == "rotary"
    heads = heads_of(width)
    cfg.model = cfg.model.replace(d_model=width, n_heads=heads, n_layers=2, max_len=length, dropout=0.0,
                                  attn_dropout=0.0, d_ff=swiglu_width(width) if rotary else 4 * width)
    cfg = kv_heads(cfg, heads // 2)
    half = ZOOLOGY_VOCAB // 2
    cfg.data.task_options = RecallOptions(n_keys=half - 1, n_values=half, pairs=pairs, queries=pairs, seq_len=length,
                                          train_size=train_size, test_size=test_size)
    t = cfg.train
    t.steps, t.batch_size, t.schedule = steps[length], batch[length], "cosine"
    t.warmup_steps = max(1, steps[length] // 10)
    t.eval_every, t.save_every, t.keep_checkpoints, t.patience, t.log_every = 0, 0, False, 0, 50
    t.compile, t.progress = False, False
    return cfg


def _blocks(kinds, rotary, gpt2="tiny-decoder", llama="llama-tiny"):
    return (Block("", gpt2, kinds),) + ((Block("rotary", llama, rotary),) if rotary else ())


GRIDS = {
    "gpu-recall-zoology": Grid(
        "recall", _blocks(RECALL_KINDS, ROTARY_ENTRIES), ZOOLOGY_CELLS, ZOOLOGY_WIDTHS, (1e-3, 3e-3, 1e-2), 3,
        functools.partial(recall_zoology, steps=RECALL_STEPS, batch=RECALL_BATCH),
        note="issue 60: recall at Zoology's scale (2 layers, widths 64-512, lengths 64-512 with 4-64 pairs, "
             "vocabulary 8,192); best of 3 learning rates, then 3 seeds"),
    # minutes on a CPU: the grid's machinery end to end (tests, a dry run of the chain)
    "cpu-recall-zoology": Grid(
        "recall", _blocks(("mha", "mhe-add"), ("mhe-mul rope-then-psi",)), ((32, 4), (64, 8)), (32, 64),
        (3e-3, 1e-2), 2,
        functools.partial(recall_zoology, steps={32: 20, 64: 20}, batch={32: 16, 64: 16}, train_size=2000,
                          test_size=100),
        note="the recall grid's machinery on a CPU: 2 cells, 2 widths, 2 rates, 2 seeds, 20 steps"),
}
