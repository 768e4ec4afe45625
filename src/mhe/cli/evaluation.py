"""Commands that use a trained run: ``mhe eval``, ``mhe translate`` and ``mhe diagnostics``.
Each loads the run with ``mhe.tasks.runs.load_run``."""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from pathlib import Path

from mhe.cli.common import DATA_DIR_HELP, add_decode_step_args, add_run_folder_arg, compile_options
from mhe.data.paths import read_source_lines
from mhe.errors import MheError, one_of
from mhe.output_paths import check_output_dir, check_output_file
from mhe.settings import check_bounds
from mhe.training.config import DataConfig, EvalPrecision, option_device

EVAL_TASKS = ("lm", "mlm", "recall", "mt", "finetune")
EVAL_PRECISIONS = typing.get_args(EvalPrecision)
DEVICE_HELP = "where the model runs: auto (a GPU if any; the default), cpu, cuda or cuda:N"


def eval_args(p):
    p.add_argument("--task", default="lm", help="the run's task: lm (sliding-window perplexity of --split; "
                                                "default), or mlm, recall, mt, finetune (the run's final evaluation)")
    add_run_folder_arg(p)
    p.add_argument("--split", default="test", choices=("valid", "test"), help="the split to score (default test)")
    p.add_argument("--stride", type=int, default=None,
                   help="sliding-window stride (default: the run's data.eval_stride, 256, capped at half the "
                        "model's window: 32 for the tiny presets' 64 tokens)")
    p.add_argument("--data-dir", default="", help=DATA_DIR_HELP)
    p.add_argument("--data", default="", help="score an lm run on this corpus instead (ptb, wikitext-2, "
                                              "wikitext-103) with the run's own tokenizer")
    p.add_argument("--precision", default=None,
                   help="tf32 (float32, TF32 matrix products on a GPU), float32 (IEEE products) or train (under the "
                        "run's training autocast: bf16 on a GPU); default: the run's data.eval_precision")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--out", default="", help="also write the figures as JSON here (default: stdout only)")


def cmd_eval(args) -> int:
    import torch

    from mhe.tasks.cross_eval import corpus_perplexity
    from mhe.tasks.runs import load_run
    from mhe.training.checkpoint import write_json_atomic
    from mhe.training.step import evaluation_precision

    if args.stride is not None:  # checked as data.eval_stride is, before the run is loaded
        stride_field = next(f for f in dataclasses.fields(DataConfig) if f.name == "eval_stride")
        check_bounds("--stride", args.stride, stride_field.metadata["bounds"])
    if args.out:
        check_output_file(args.out, "--out", parent_must_exist=True)
    if args.task not in EVAL_TASKS:
        raise one_of("--task", args.task, EVAL_TASKS)
    if args.precision is not None and args.precision not in EVAL_PRECISIONS:
        raise one_of("--precision", args.precision, EVAL_PRECISIONS)
    device = option_device(args.device)
    if args.data and args.task != "lm":
        raise MheError(f"--data scores language-modelling runs; --task is {args.task!r}")
    # the run's type first; then only its tokenizer and the split scored are read
    model, cfg, task = load_run(args.run, data_dir=args.data_dir, inference=True, tasks=(args.task,),
                                needs=f"--task says {args.task!r}", device=device)
    if args.stride is not None:
        cfg.data.eval_stride = args.stride
    if args.precision is not None:
        cfg.data.eval_precision = args.precision
    with torch.no_grad(), evaluation_precision(cfg, device):  # data.eval_precision, or --precision
        if args.data:
            res = corpus_perplexity(task, model, cfg, args.data, args.split)
        elif cfg.task == "lm":
            res = task.split_perplexity(model, args.split, progress=cfg.train.progress)
        else:
            res = task.final(model)
    if args.out:
        write_json_atomic(args.out, res)
    print(json.dumps(res, indent=2))
    return 0


def translate_args(p):
    add_run_folder_arg(p, "a translation run folder (mhe train-mt), or one of its checkpoints/step-N folders")
    p.add_argument("--input", default="-", help="a file of source lines, plain, gzip or xz (default: stdin)")
    p.add_argument("--beam", type=int, default=None, help="beam size, 1 = greedy (default: the run's)")
    p.add_argument("--alpha", type=float, default=None,
                   help="length penalty alpha >= 0 of beam search (default: the run's)")
    p.add_argument("--dtype", default=None,
                   help="decode in float32 (the default) or bfloat16 (faster on GPU; the output may differ)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_decode_step_args(p)


def cmd_translate(args) -> int:
    from mhe.tasks.runs import load_run
    from mhe.tasks.translation import DECODE_DTYPES

    if args.beam is not None and args.beam <= 0:
        raise MheError(f"--beam must be a positive integer (1 is greedy), got {args.beam}")
    if args.alpha is not None and not (math.isfinite(args.alpha) and args.alpha >= 0):
        raise MheError(f"--alpha must be a finite length penalty >= 0, got {args.alpha}")
    if args.dtype is not None and args.dtype not in DECODE_DTYPES:
        raise MheError(f"--dtype must be one of {', '.join(DECODE_DTYPES)}, got {args.dtype!r}")
    if args.input != "-" and not Path(args.input).is_file():
        raise MheError(f"--input {args.input} does not exist")
    device = option_device(args.device)
    step_options = compile_options(args.compile_options)
    lines = read_source_lines(args.input)  # before the model loads: bad input fails at once
    model, cfg, task = load_run(args.run, inference=True, tasks=("mt",),  # the run folder alone: no corpus
                                needs="mhe translate needs a translation (mt) run", device=device)
    for hyp in task.translate(model, lines, beam=args.beam, alpha=args.alpha, progress=cfg.train.progress,
                              dtype=args.dtype, step_mode=args.step_mode, compile_options=step_options):
        print(hyp)
    return 0


def diagnostics_args(p):
    add_run_folder_arg(p, "a run folder fine-tuned on RTE (mhe finetune --task rte)")
    p.add_argument("--tasks", default="ax-b,ax-g", help="comma-separated diagnostics: ax-b, ax-g (default both)")
    p.add_argument("--data-dir", default="", help=DATA_DIR_HELP)
    p.add_argument("--out", default="", help="write SuperGLUE submission files (AX-b.jsonl, AX-g.jsonl) here")


def cmd_diagnostics(args) -> int:
    from mhe.tasks.diagnostics import evaluate_diagnostics

    tasks = tuple(t.strip() for t in args.tasks.split(",") if t.strip())
    if args.out:
        check_output_dir(args.out, "--out")
    res = evaluate_diagnostics(args.run, tasks=tasks, data_dir=args.data_dir, out=args.out)
    print(json.dumps(res, indent=2))
    return 0
