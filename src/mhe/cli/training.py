"""Training commands: ``mhe train``, ``mhe pretrain``, ``mhe train-mt``, ``mhe finetune`` and
``mhe run``. Each builds a typed ``RunConfig`` (``mhe.training.defaults``) and hands it to
``mhe.tasks.runs.run_training``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from mhe.errors import MheError
from mhe.experiments.summary import metric_means
from mhe.models import preset
from mhe.output_paths import check_output_dir, default_run_dir
from mhe.tasks.finetune_config import finetune_config
from mhe.tasks.init_from import continued_run, source_config
from mhe.tasks.runs import exit_status, run_training
from mhe.training.checkpoint import write_json_atomic
from mhe.training.config import check_device
from mhe.training.defaults import build_run
from mhe.training.loop import DONE
from mhe.training.run_files import RESULTS, is_run_dir, read_results, read_run_config_file

PRETRAIN_TASK = {"decoder": "lm", "encoder": "mlm"}  # the objective of each architecture (section 4.1)
FINETUNE_TASKS = ("rte, mrpc, cola, sst2, stsb, qnli, qqp, mnli, mnli-mm, boolq, cb, sg-rte, wic, multirc, copa, "
                  "wsc, squad, squad-v2")


def add_set_args(p) -> None:
    """``--set`` and ``--resume``, shared by every command that trains."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting (repeatable), e.g. train.lr=3e-4, train.steps=200, model.dropout=0")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")


def add_run_args(p, *, task_choice: bool, preset_default: str | None = None, data_default: str = "",
                 data_help: str = "dataset: ptb, wikitext-2, wikitext-103",
                 out_help: str = "runs/TASK-DATA-PRESET-KIND", from_source: bool = False) -> None:
    """The options every single-run training command shares (``from_source``: preset and kind
    may come from the run given by ``--init-from``)."""
    if task_choice:
        p.add_argument("--task", required=True, help="lm, mlm or recall")
    if from_source:
        p.add_argument("--preset", default=None, help="model preset (tiny-decoder, gpt2-base, bert-base, ...); "
                                                      "with --init-from: default the source run's")
    elif preset_default is None:
        p.add_argument("--preset", required=True, help="model preset (tiny-decoder, gpt2-base, bert-base, ...)")
    else:
        p.add_argument("--preset", default=preset_default, help=f"model preset (default {preset_default})")
    p.add_argument("--attention", default=None if from_source else "mha",
                   help="attention kind (mha, mhe-mul, ...): sets model.attention (default mha"
                        + ("; with --init-from: the source run's kind)" if from_source else ")"))
    p.add_argument("--data", default=data_default, help=data_help)
    p.add_argument("--data-dir", default="", help="data folder (default: $MHE_DATA or ../shared/data)")
    p.add_argument("--out", default="", help=f"run directory (default {out_help})")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: train.seed, 0)")
    add_set_args(p)


def _run_from_args(task: str, args, task_options: dict | None = None):
    return build_run(task, args.preset, attention=args.attention, data=args.data, data_dir=args.data_dir,
                     seed=args.seed, overrides=args.set, task_options=task_options)


def print_result(res: dict) -> None:
    keys = [k for k in ("status", "step", "task", "attention", "metric", "score", "perplexity", "word_perplexity",
                        "accuracy", "mlm_accuracy", "attention_params", "out") if k in res]
    print(json.dumps({k: res[k] for k in keys}, indent=2))


def train_args(p):
    add_run_args(p, task_choice=True)


def cmd_train(args) -> int:
    res = run_training(_run_from_args(args.task, args), args.out, args.resume)
    print_result(res)
    return exit_status(res)


def pretrain_args(p):
    add_run_args(p, task_choice=False, from_source=True)
    p.add_argument("--init-from", default="", metavar="RUN",
                   help="continue pre-training (or uptrain a converted run, mhe convert): start from RUN's weights, "
                        "tokenizer and model settings, with a fresh optimiser and a warm-up of 5%% of the steps "
                        "unless train.warmup_* is set")


def cmd_pretrain(args) -> int:
    source = source_config(args.init_from) if args.init_from else None
    args.preset = args.preset or (source.preset if source else None)
    if args.preset is None:
        raise MheError("pretrain needs --preset (tiny-decoder, gpt2-base, bert-base, ...) or --init-from RUN")
    args.attention = args.attention or (source.kind if source else "mha")
    if source is not None and args.attention != source.kind:
        raise MheError(f"--attention {args.attention} differs from the kind of --init-from {args.init_from} "
                       f"({source.kind}), whose weights it starts from; convert it first: mhe convert "
                       f"--checkpoint {args.init_from} --attention {args.attention}")
    task = PRETRAIN_TASK.get(preset(args.preset).arch)
    if task is None:
        raise MheError(f"pretrain takes an encoder or decoder preset; {args.preset!r} is an encoder-decoder "
                       "(train it with translation)")
    if not args.data:
        raise MheError("pretrain needs --data (ptb, wikitext-2 or wikitext-103)")
    cfg = _run_from_args(task, args)
    if source is not None:
        cfg = continued_run(cfg, source, args.set)
        cfg.train.init_from = str(args.init_from)
    res = run_training(cfg, args.out, args.resume)
    print_result(res)
    return exit_status(res)


def train_mt_args(p):
    add_run_args(p, task_choice=False, preset_default="transformer-base", data_default="multi30k",
                 data_help="parallel corpus: multi30k (default) or wmt14", out_help="runs/mt-DATA-SRC-TGT-PRESET-KIND")
    p.add_argument("--src", default="en", help="source language code (default en)")
    p.add_argument("--tgt", default="de", help="target language code (default de)")


def cmd_train_mt(args) -> int:
    # the languages go in first, so a user's --set data.task_options.src=... wins
    cfg = _run_from_args("mt", args, task_options={"src": args.src, "tgt": args.tgt})
    o = cfg.data.task_options
    out = args.out or str(default_run_dir("mt", cfg.data.dataset, f"{o.src}-{o.tgt}", cfg.preset, cfg.model.attention))
    res = run_training(cfg, out, args.resume)
    keys = ("status", "step", "attention", "bleu", "bleu_last5_mean", "signature", "attention_params", "out")
    print(json.dumps({k: res[k] for k in keys if k in res}, indent=2))
    return exit_status(res)


def finetune_args(p):
    p.add_argument("--task", required=True, help=f"benchmark task: {FINETUNE_TASKS}")
    p.add_argument("--checkpoint", required=True, help="the pre-training run directory")
    p.add_argument("--seeds", type=int, default=1, help="run this many seeds and report mean and std (default 1)")
    p.add_argument("--data-dir", default="", help="data folder (default: $MHE_DATA or ../shared/data)")
    p.add_argument("--out", default="", help="run directory (default runs/finetune-TASK-CHECKPOINT)")
    add_set_args(p)


def cmd_finetune(args) -> int:
    if args.seeds <= 0:
        raise MheError(f"--seeds must be positive, got {args.seeds}")
    out = Path(args.out or default_run_dir("finetune", args.task, Path(args.checkpoint).resolve().name))
    if args.resume and not out.is_dir():
        raise MheError(f"--resume: there is no run in {out}; drop --resume to start one")
    results = []
    check_output_dir(out)  # before the checkpoint or any data is read
    for seed in range(args.seeds):
        cfg = finetune_config(args.task, args.checkpoint, data_dir=args.data_dir, overrides=args.set, seed=seed)
        run_dir = out / f"seed-{seed}" if args.seeds > 1 else out
        # with several seeds, --resume continues the seeds that started and starts the others
        resume = args.resume and (args.seeds == 1 or is_run_dir(run_dir))
        res = run_training(cfg, str(run_dir), resume) if resume or not (run_dir / RESULTS).exists() \
            else read_results(run_dir)
        if res["status"] not in DONE:
            print_result(res)
            return exit_status(res)
        results.append(res)
    scores = [r["score"] for r in results]
    summary = {"task": args.task, "metric": results[0]["metric"], "attention": results[0]["attention"],
               "scores": scores, "mean": statistics.fmean(scores),
               "std": statistics.stdev(scores) if len(scores) > 1 else 0.0, "n_seeds": len(scores)}
    summary["metrics"] = metric_means(results)  # every official metric; `metric` is the paper's headline
    if args.seeds > 1:
        write_json_atomic(out / "summary.json", summary)
    print(json.dumps(summary, indent=2))
    return 0


def run_args(p):
    p.add_argument("--config", required=True, help="a run.json written by mhe compare")
    p.add_argument("--out", required=True, help="the run directory to train into")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")


def cmd_run(args) -> int:
    cfg = read_run_config_file(args.config)  # checks every setting
    check_device(cfg.train.device)
    res = run_training(cfg, args.out, args.resume)
    if res["status"] in DONE:
        return 0
    return exit_status(res) or 3  # interrupted: 130/143; stopped early by train.stop_at: 3
