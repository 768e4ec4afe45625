#!/usr/bin/env python
"""Uptraining study: from a pre-trained MHA decoder to MQA, GQA, MHE-Mul, MHE-Add and SHA.

    python benchmarks/uptrain.py study --data-dir DATA --out results/uptrain-gpt2-6x384
    python benchmarks/uptrain.py study --preset llama-135m --data-dir DATA --out results/uptrain-llama-135m
    python benchmarks/uptrain.py study --preset llama-6x512 --data-dir DATA --out results/uptrain-llama-6x512
    python benchmarks/uptrain.py study --cpu-smoke --data-dir DATA --out /tmp/uptrain-smoke

1. Pre-train an MHA decoder (GPT-2-shaped, or the Llama-style ``llama-135m`` with rotary
   positions, or ``llama-6x512``: that layer at the shape of the from-scratch comparison
   ``gpu-llama-6x512``, issue 43) on ``offline-english`` for N steps (``mhe pretrain``).
2. Convert it to every kind (``mhe convert``'s fitted initialisation, through its Python API,
   in this process) and score each converted model on WikiText-2's test split before training
   (and the naive initialisation, mean of the heads and zero head embeddings, beside it).
3. Uptrain each converted model for each fraction of N (default 5% and 10%) and each seed
   (``mhe pretrain --init-from CONVERTED --set train.steps=F*N``), the documented recipe.
4. Beside them, train each kind from scratch for N + the longest uptraining (the same number
   of optimiser steps of the same batch as the uptrained model has seen in all).

Independent trainings run at the same time as processes on the one GPU (as ``mhe compare
--workers`` does): the scratch runs start with the pre-training, the uptraining runs when the
conversions are done, seed 0 of every kind first. With a wall-time budget (``--budget-s``) a
later seed is only started when its estimated time fits, and at the budget every run still
going is stopped (it saves and exits), so the study ends on time and says what ran. Everything
is written under ``--out``: ``RUN.md`` (what the study is, how to reproduce it, card, software,
wall time, what ran), ``summary.md`` / ``summary.csv`` / ``summary.json``, ``uptrain.png``
(perplexity against uptraining steps per kind) and the run folders under ``runs/``.
``--cpu-smoke`` runs every stage on a tiny model in this one process (``--inline``), in seconds;
``--dry-run`` checks every configuration and conversion and prints the commands.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from uptraining.jobs import common_sets, train_job, uptrain_job
from uptraining.report import (markdown_table, plot, portable_command, software, summarise,
                            write_run_md, write_tables)
from uptraining.stages import run_study

from mhe.experiments.presets import LLAMA_6x512

KINDS = ("mqa", "gqa", "mhe-mul", "mhe-add", "sha")
# the default model: GPT-2's layout at 6 layers x 384, 8 heads of 48 (GQA: 2 K/V heads), 256 tokens
GPT2_6x384 = ("model.n_layers=6", "model.d_model=384", "model.n_heads=8", "model.d_ff=1536", "model.max_len=256")
MODEL_SETS = {"gpt2-base": GPT2_6x384, "llama-135m": ("model.max_len=256",)}  # the llama: 30 x 576, 9 heads
# study shapes: a model preset at other sizes, with the study's defaults for it. llama-6x512 is the
# shape of `mhe compare --preset gpu-llama-6x512` (6 layers x 512, 8 heads of 64, GQA 2 K/V heads),
# pre-trained for 1200 steps so the study fits about 6 minutes of one H100 (issue 43; the GPT-2
# study's 2000 steps of a 6 x 384 model took 6.1 min, and this model costs about 1.7 times as much
# a token), scored on PTB's test split as well.
SHAPES = {"llama-6x512": dict(preset="llama-135m", model_set=tuple(f"model.{k}={v}" for k, v in LLAMA_6x512.items()),
                              n_kv_heads=LLAMA_6x512["n_heads"] // 4, steps=1200,
                              kinds=("mqa", "gqa", "mhe-mul", "mhe-add"), also_test="ptb")}
SMOKE_MODEL = ("model.n_layers=2", "model.d_model=32", "model.n_heads=8", "model.d_ff=64", "model.max_len=32")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="uptrain.py study", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("MHE_DATA", ""), help="data folder (default $MHE_DATA)")
    p.add_argument("--out", required=True, help="output folder (results/uptrain-...)")
    p.add_argument("--preset", default=None,
                   help="model preset of the decoder: gpt2-base (default), llama-135m (the Llama-style decoder: "
                        "RMSNorm, SwiGLU, rotary positions) or llama-6x512 (that decoder at 6 x 512, GQA with 2 K/V "
                        "heads, 1200 steps, also scored on PTB); --cpu-smoke: tiny-decoder (default), llama-tiny "
                        "or llama-6x512 (its layer at the smoke size)")
    p.add_argument("--model-set", action="append", default=None, metavar="model.KEY=VALUE",
                   help="model settings (default for gpt2-base: 6 layers x 384, 8 heads, d_ff 1536, 256 tokens; "
                        "for llama-135m: its own sizes at 256 tokens)")
    p.add_argument("--data", default=None, help="the training corpus (default offline-english; --cpu-smoke: "
                                                 "wikitext-2); the scores are on its test split")
    p.add_argument("--steps", type=int, default=None, help="pre-training steps N (default 2000; llama-6x512: 1200)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of every run (default 1e-3)")
    p.add_argument("--vocab-size", type=int, default=8192, help="byte-level BPE size (default 8192)")
    p.add_argument("--fractions", default="0.05,0.1", help="uptraining steps as fractions of N (default 0.05,0.1)")
    p.add_argument("--seeds", type=int, default=3, help="uptraining seeds per kind and fraction, as the budget "
                                                        "allows (default 3)")
    p.add_argument("--kinds", default=None, help=f"kinds to convert to (default {','.join(KINDS)}; llama-6x512: "
                                                 "mqa,gqa,mhe-mul,mhe-add)")
    p.add_argument("--also-test", default=None, metavar="CORPUS[,CORPUS]",
                   help="score every trained run on these corpora's test splits as well (lm's also_test; "
                        "default none; llama-6x512: ptb)")
    p.add_argument("--n-kv-heads", type=int, default=0,
                   help="GQA's K/V heads, converted and from scratch (default: the preset's own for a GQA preset, "
                        "e.g. 3 for llama-135m; else n/4)")
    p.add_argument("--no-align", dest="align", action="store_false",
                   help="convert without head alignment (default: aligned fit)")
    p.add_argument("--workers", type=int, default=12, help="training processes at a time (default 12)")
    p.add_argument("--budget-s", type=float, default=0,
                   help="wall-time budget in seconds: a later seed starts only if its estimated time fits, and "
                        "at the budget every run still going is stopped (default 0: none)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every training run (default: eager; a dozen processes compiling at once "
                        "would spend more time compiling than the short uptraining runs train)")
    p.add_argument("--limit-lines", type=int, default=0, help="data.limit_lines of every run (0: all)")
    p.add_argument("--inline", action=argparse.BooleanOptionalAction, default=None,
                   help="run the trainings one after another in this process instead of as parallel processes "
                        "(default: only with --cpu-smoke)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a tiny model for a few steps on the CPU: every stage, in seconds")
    p.add_argument("--dry-run", action="store_true",
                   help="check every run's configuration and conversion, print the commands, run nothing")
    return resolve(p.parse_args(argv))


def resolve(args):
    """The defaults that depend on other arguments (the preset or study shape, --cpu-smoke)."""
    shape = SHAPES.get(args.preset, {})
    if shape:
        args.preset = shape["preset"]
        if args.model_set is None and not args.cpu_smoke:
            args.model_set = list(shape["model_set"])
        args.n_kv_heads = args.n_kv_heads or shape["n_kv_heads"]
        args.kinds = args.kinds or ",".join(shape["kinds"])
    args.steps = args.steps or shape.get("steps", 2000)
    args.also_test = shape.get("also_test", "") if args.also_test is None else args.also_test
    if args.cpu_smoke:
        args.preset = args.preset or "tiny-decoder"
        args.model_set = list(SMOKE_MODEL) if args.model_set is None else args.model_set
        args.steps, args.batch_size, args.vocab_size, args.seeds = 24, 4, 300, 1
        args.fractions, args.limit_lines, args.workers = "0.25", 40, 4
    args.inline = args.cpu_smoke if args.inline is None else args.inline
    args.preset = args.preset or "gpt2-base"
    args.data = args.data or ("wikitext-2" if args.cpu_smoke else "offline-english")
    if args.model_set is None:
        args.model_set = list(MODEL_SETS.get(args.preset, ()))
    args.fractions = tuple(float(f) for f in args.fractions.split(","))
    args.kinds = tuple(k.strip() for k in (args.kinds or ",".join(KINDS)).split(",") if k.strip())
    if not args.n_kv_heads:
        from mhe.models import preset

        own = preset(args.preset)
        args.n_kv_heads = getattr(own.attn_options, "n_kv_heads", 0) if own.attention == "gqa" else 0
    return args


def check_plan(args) -> list[str]:
    """Every run's configuration built as ``mhe pretrain`` builds it and every conversion checked
    (no data read, no model built); one line per kind with its analytic sizes."""
    from mhe.accounting.memory import decoder_memory
    from mhe.accounting.params import decoder_params
    from mhe.convert.model import check_conversion
    from mhe.tasks import build_run

    lines, source = [], None
    for kind in ("mha", *args.kinds):
        cfg = build_run("lm", args.preset, attention=kind, data=args.data, data_dir=args.data_dir,
                        overrides=common_sets(args, kind))
        if source is None:
            source = cfg.model
        else:
            opts = check_conversion(source, kind, args.n_kv_heads if kind == "gqa" else 0)
            if cfg.model.attn_options != opts:
                raise SystemExit(f"{kind}: from scratch with {cfg.model.attn_options}, converted with {opts}")
        mem = decoder_memory(cfg.model)
        lines.append(f"{kind}: {decoder_params(cfg.model)['attention']:,} attention parameters, "
                     f"{mem['kv_cache_bytes_per_token']:,} B of KV cache per token (bf16), {mem['params']:,} "
                     f"parameters at the preset's vocabulary, options {cfg.model.attn_options}")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    command = portable_command(sys.argv[1:] if argv is None else list(argv))
    if args.dry_run:
        for line in check_plan(args):
            print(line, file=sys.stderr)
        runs = out / "runs"
        longest = max(round(f * args.steps) for f in args.fractions)
        for j in [train_job(args, runs, "mha", args.steps, "pretrain"),
                  *(train_job(args, runs, k, args.steps + longest, "scratch") for k in args.kinds),
                  *(uptrain_job(args, runs, k, f, s) for s in range(args.seeds) for f in args.fractions
                    for k in args.kinds)]:
            print("mhe " + " ".join(shlex.quote(a) for a in j.args))
        return 0
    if not args.data_dir:
        sys.exit(f"give --data-dir (or set MHE_DATA): the folder {args.data} is read from")
    if (out / "runs.tar.xz").is_file():
        sys.exit(f"{out} is packed (runs.tar.xz); unpack it first to continue the study: mhe report --unpack {out}")
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with open(out / "study.log", "a") as logf:
        def log(msg: str) -> None:
            line = f"{time.strftime('%H:%M:%S')} {msg}"
            print(line, flush=True)
            logf.write(line + "\n")
            logf.flush()

        from mhe.runtime import configure_threads

        configure_threads()
        sw = software()
        log(f"uptraining study on {sw['card']}, torch {sw['torch']} -> {out}")
        study = run_study(args, out, log)
        summary = summarise(args, out, study)
        write_tables(args, out, summary)
        plot(args, out, summary)
        write_run_md(args, out, study, summary, sw, command, started)
        log(f"wrote {out}/RUN.md, summary.md/.csv/.json, uptrain.png ({study['wall_s']:.0f} s)")
        print(markdown_table(args, summary["rows"]))
    return 0 if all(j.rc == 0 for j in study["jobs"] if j.role != "uptrain" or j.seed == 0) else 1

