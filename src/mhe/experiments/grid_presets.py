"""Grid presets (:mod:`mhe.experiments.grid`): recall at Zoology's scale (issue 60).

Zoology's MQAR figure (Arora et al. 2023, figure 2; its repository's configurations): decoders
of 2 layers at widths 64, 128, 256 and 512; sequence lengths 64, 128, 256 and 512 with 4, 8, 16
and 64 key-value pairs, every pair queried, queries at power-law distances (``power_a`` 0.01),
padding between them; a vocabulary of 8,192 (keys from one half, values from the other);
100,000 training and 3,000 test sequences; learning rates 1e-4 to 1e-2 (4 of them), 64 epochs.

Ours: the same cells, widths, vocabulary and layout, 100,000 training and 1,000 test sequences
per cell; attention-only layers as Zoology's (``model.mlp="none"``: its state mixer is the
identity), every kind in a GPT-2 block (learned positions, LayerNorm), MHE-Mul in both rotary
orders and MHA beside them in a Llama-style block (RMSNorm, rotary positions); heads of 16 at
width 64 (4 heads), up to heads of 64 from width 256 (``max(4, width // 64)`` heads); GQA keeps
half the heads as K/V heads; no dropout; AdamW with weight decay 0.1; Zoology's batches
(:data:`RECALL_BATCH`). Each kind at its best of three learning rates (seed 0; where the best is
an edge of the three and strictly above its neighbour, one more rate past that edge:
``Grid.extend``), then 3 seeds at that rate. :data:`RECALL_STEPS` per length, 10% warm-up,
cosine: far fewer than Zoology's 64 epochs (which stop at 99% test accuracy), the same for every
kind. ``--set train.steps=N`` trains longer.

Calibration on a CPU (MHA, length 64, 4 pairs, width 64 as 4 heads of 16, lr 3e-3, vocabulary
8,192). With a GPT-2 block's feed-forward and batches of 64, test accuracy stays at the plateau
of a model that only knows the answer is one of the listed values (0.146, 0.211, 0.226, 0.230 at
steps 250, 500, 1000, 1500); batches of 512 alone do not leave it (0.22 after 600 steps, constant
or cosine rate). Without the feed-forward, as Zoology's models, batches of 512 leave it after
about 300 steps: 0.58, 0.87 and 0.90 at steps 300, 400 and 500 of a 600-step cosine schedule
(warm-up 60, weight decay 0.1; 0.43 s a step on one CPU thread); one head of 64 at a constant
rate reaches 0.97 by step 250. The preset itself (800 steps, trained by ``mhe``'s engine) gives
MHA 0.935 at this cell. Batches of 64 without the feed-forward were not tried; at a
vocabulary of 256 a minimal attention-only model at batch 64 leaves the plateau after about
1,200 steps, at 8,192 not within 5,000. The longer lengths: :data:`RECALL_STEPS`.
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
RECALL_STEPS = {64: 800, 128: 1000, 256: 3600, 512: 9000}
"""Steps per sequence length of ``gpu-recall-zoology``: at length 64 past the step (about 500)
where MHA at width 64 reaches 0.9 (the module's calibration); at length 128 MHA left the plateau
by steps 350-550 of 1,000 at every width (the grid's training losses). Lengths 256 and 512 first
ran 1,200 and 1,500 steps: at length 256 MHA stayed at the plateau at widths 256 and 512 on every
rate, its training loss falling only at epoch boundaries (memorising the 100,000 sequences),
while EL-att left it between steps 900 and 1,000 and GQA on one rate of four; the cell would
have ranked the kinds by luck near the end of training. Three times those steps (about 9 and 6 epochs,
Zoology's runs up to 64) give the slower learners the time the fast ones took, an estimate that
the first runs' training losses check (results/recall-zoology/RUN.md). At length 512 they did
not: 23 runs at 4,500 steps (width 512) all stayed on the plateau, and length 512 went to 9,000
(those runs kept aside in ``runs-4500-steps.tar.xz``), where its runs stay there too, at every
width. At both budgets their training loss falls at epoch starts: they memorise the 100,000
sequences, so more steps are not length 512's lever; nor is a larger training set:
``gpu-recall-fresh-512`` (each of 1,152,000 sequences seen once) left no run off the plateau."""
RECALL_BATCH = {64: 512, 128: 512, 256: 256, 512: 128}
"""Sequences per step by length, Zoology's (its figure 2 configurations): 32k tokens a step at
length 64, 64k from 128 on; queried values a step: 2,048, 4,096, 4,096 and 8,192. Large batches
are what let a small model leave the recall plateau early (the module's calibration)."""
RECALL_WEIGHT_DECAY = 0.1
"""AdamW's weight decay, Zoology's."""
RECALL_COMPILED_FROM = 256
"""The shortest length whose runs are compiled (``train.compile``). Eight pooled processes on one
H200 at length 256, width 512 (MHA) took 7.39 ms of the card a step eagerly and 2.17 compiled
(``train_bench.py recall-step --cells 256:512 --compiled no,yes --concurrent 1,8``): the eager
steps' memory-bound elementwise kernels keep the card busy, the compiled ones fuse them. The
shorter lengths ran eagerly before this was measured and stay so, so that a cell's runs are alike."""


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
                                  attn_dropout=0.0, mlp="none",  # attention-only, as Zoology's models
                                  d_ff=swiglu_width(width) if rotary else 4 * width)  # unused
    cfg = kv_heads(cfg, heads // 2)
    half = ZOOLOGY_VOCAB // 2
    cfg.data.task_options = RecallOptions(n_keys=half - 1, n_values=half, pairs=pairs, queries=pairs, seq_len=length,
                                          train_size=train_size, test_size=test_size)
    t = cfg.train
    t.steps, t.batch_size, t.schedule = steps[length], batch[length], "cosine"
    t.weight_decay = RECALL_WEIGHT_DECAY
    t.warmup_steps = max(1, steps[length] // 10)
    t.eval_every, t.save_every, t.keep_checkpoints, t.patience, t.log_every = 0, 0, False, 0, 50
    t.compile, t.progress = length >= RECALL_COMPILED_FROM, False
    return cfg


def _blocks(kinds, rotary, gpt2="tiny-decoder", llama="llama-tiny"):
    return (Block("", gpt2, kinds),) + ((Block("rotary", llama, rotary),) if rotary else ())


GRIDS = {
    "gpu-recall-zoology": Grid(
        "recall", _blocks(RECALL_KINDS, ROTARY_ENTRIES), ZOOLOGY_CELLS, ZOOLOGY_WIDTHS, (1e-3, 3e-3, 1e-2), 3,
        functools.partial(recall_zoology, steps=RECALL_STEPS, batch=RECALL_BATCH),
        note="issue 60: recall at Zoology's scale (2 layers, widths 64-512, lengths 64-512 with 4-64 pairs, "
             "vocabulary 8,192); best of 3 learning rates (one more past an edge the best lies on), then 3 seeds",
        extend=1),
    # does fresh data let length 512 leave the plateau? No (results/recall-zoology/RUN.md, "Two
    # probes"): the grid's length-512 runs at width 512 and lr 1e-3, seed 0, each training sequence
    # seen once, all stay on it
    "gpu-recall-fresh-512": Grid(
        "recall", _blocks(("mha", "gqa", "mqa"), ("mhe-mul rope-then-psi",)), ((512, 64),), (512,), (1e-3,), 1,
        functools.partial(recall_zoology, steps=RECALL_STEPS, batch=RECALL_BATCH,
                          train_size=RECALL_STEPS[512] * RECALL_BATCH[512]),
        note="issue 60: length 512 at width 512 on 1,152,000 training sequences (9,000 steps of 128, "
             "each once) against the grid's 100,000: MHA, GQA, MQA, rotary MHE-Mul, lr 1e-3, seed 0"),
    # minutes on a CPU: the grid's machinery end to end (tests, a dry run of the chain)
    "cpu-recall-zoology": Grid(
        "recall", _blocks(("mha", "mhe-add"), ("mhe-mul rope-then-psi",)), ((32, 4), (64, 8)), (32, 64),
        (3e-3, 1e-2), 2,
        functools.partial(recall_zoology, steps={32: 20, 64: 20}, batch={32: 16, 64: 16}, train_size=2000,
                          test_size=100),
        note="the recall grid's machinery on a CPU: 2 cells, 2 widths, 2 rates, 2 seeds, 20 steps"),
}
