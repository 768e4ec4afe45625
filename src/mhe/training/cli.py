"""``mhe train``, ``mhe pretrain`` and ``mhe eval``."""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
from pathlib import Path

from mhe.cli import command
from mhe.errors import MheError
from mhe.output_paths import check_output_dir, default_run_dir


def add_run_args(p, *, task_choice: bool) -> None:
    if task_choice:
        p.add_argument("--task", required=True, help="lm, mlm or recall")
    p.add_argument("--preset", required=True, help="model preset (tiny-decoder, gpt2-base, bert-base, ...)")
    p.add_argument("--attention", default="mha", help="attention kind (mha, mhe-mul, ...): sets model.attention")
    p.add_argument("--data", default="", help="dataset: ptb, wikitext-2, wikitext-103")
    p.add_argument("--data-dir", default="", help="data folder (default: $MHE_DATA or ../shared/data)")
    p.add_argument("--out", default="", help="run directory (default runs/TASK-DATA-PRESET-KIND)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. train.lr=3e-4, train.steps=200, model.dropout=0")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")


def build_run(task: str, args, *, task_options: dict | None = None):
    """The run's typed configuration: the task's defaults, then ``--attention``, ``--data``,
    ``--seed`` and every ``--set`` item, all checked before anything is read or written."""
    from mhe.training.config import apply_overrides
    from mhe.training.defaults import default_run

    cfg = default_run(task, args.preset, "mha", args.data)
    items = [f"model.attention={args.attention}"]
    if args.data_dir:
        cfg.data.data_dir = args.data_dir
    if args.seed is not None:
        items.append(f"train.seed={args.seed}")
    if task_options:
        items.append(f"data.task_options={json.dumps(task_options)}")
    return apply_overrides(cfg, items + list(args.set))


def run_training(cfg, out: str, resume: bool) -> dict:
    from mhe.tasks import build_task
    from mhe.training.loop import Trainer

    out = out or str(default_run_dir(cfg.task, cfg.data.dataset, cfg.preset, cfg.model.attention))
    check_output_dir(out)  # before any data is read: a bad --out fails at once
    result = Trainer(cfg, build_task(cfg.task), out, resume=resume, log=lambda m: print(m, file=sys.stderr)).fit()
    return {**result, "out": out}


def exit_status(res: dict) -> int:
    """0 for a run that finished (or stopped where ``train.stop_at`` said); 128 + the signal
    number (130 for SIGINT, 143 for SIGTERM) for a run a signal interrupted after saving."""
    if res.get("status") == "interrupted":
        return 128 + int(res.get("signal") or signal.SIGINT)
    return 0


def _print_result(res: dict) -> None:
    keys = [k for k in ("status", "step", "task", "attention", "metric", "score", "perplexity", "word_perplexity",
                        "accuracy", "mlm_accuracy", "attention_params", "out") if k in res]
    print(json.dumps({k: res[k] for k in keys}, indent=2))


def _train_args(p):
    add_run_args(p, task_choice=True)


@command("train", "train a model on a task (lm, mlm, recall) with the shared engine", _train_args)
def cmd_train(args) -> int:
    cfg = build_run(args.task, args)
    res = run_training(cfg, args.out, args.resume)
    _print_result(res)
    return exit_status(res)


def _pretrain_args(p):
    add_run_args(p, task_choice=False)
    p.add_argument("--init-from", default="", metavar="RUN",
                   help="continue pre-training: start from RUN's weights and tokenizer, with a fresh optimiser")


@command("pretrain", "pre-train: causal LM for decoder presets, masked LM for encoder presets", _pretrain_args)
def cmd_pretrain(args) -> int:
    from mhe.models import preset

    task = {"decoder": "lm", "encoder": "mlm"}.get(preset(args.preset).arch)
    if task is None:
        raise MheError(f"pretrain takes an encoder or decoder preset; {args.preset!r} is an encoder-decoder "
                       "(train it with translation)")
    if not args.data:
        raise MheError("pretrain needs --data (ptb, wikitext-2 or wikitext-103)")
    cfg = build_run(task, args)
    if args.init_from:
        cfg.train.init_from = str(args.init_from)
    res = run_training(cfg, args.out, args.resume)
    _print_result(res)
    return exit_status(res)


def _eval_args(p):
    p.add_argument("--task", default="lm", help="lm (perplexity), mlm, recall")
    p.add_argument("--checkpoint", required=True, help="a run directory (its newest checkpoint) or a checkpoint folder")
    p.add_argument("--split", default="test", choices=("valid", "test"))
    p.add_argument("--stride", type=int, default=None, help="sliding-window stride (default: the run's)")
    p.add_argument("--data-dir", default="")
    p.add_argument("--data", default="", help="score an lm run on this corpus instead (ptb, wikitext-2, "
                                              "wikitext-103) with the run's own tokenizer")
    p.add_argument("--out", default="", help="write the figures as JSON here (default: stdout)")


@command("eval", "evaluate a trained run (perplexity with a sliding window of stride 256)", _eval_args)
def cmd_eval(args) -> int:
    from mhe.checkpoint_io import load_run
    from mhe.settings import check_bounds

    if args.stride is not None:  # checked as data.eval_stride is, before the run is loaded
        from mhe.training.config import DataConfig

        stride_field = next(f for f in dataclasses.fields(DataConfig) if f.name == "eval_stride")
        check_bounds("--stride", args.stride, stride_field.metadata["bounds"])
    if args.out:
        from mhe.output_paths import check_output_file

        check_output_file(args.out, "--out", parent_must_exist=True)
    model, cfg, task = load_run(args.checkpoint, data_dir=args.data_dir)
    if args.task != cfg.task:
        raise MheError(f"{args.checkpoint} is a {cfg.task!r} run, not {args.task!r}")
    if args.stride is not None:
        cfg.data.eval_stride = args.stride
    if args.data:
        from mhe.tasks.cross_eval import corpus_perplexity

        res = corpus_perplexity(task, model, cfg, args.data, args.split)
    elif cfg.task == "lm":
        from mhe.tasks.text import corpus_lines, token_stream

        lines = corpus_lines(cfg, args.split)
        res = task._ppl(model, token_stream(task.tok, lines), lines, task.stride(), progress=cfg.train.progress)
        res = {"split": args.split, "stride": task.stride(), **res}
    else:
        res = task.final(model)
    text = json.dumps(res, indent=2)
    if args.out:
        from mhe.training.checkpoint import write_json_atomic

        write_json_atomic(args.out, res)
    print(text)
    return 0


def _mt_args(p):
    p.add_argument("--preset", default="transformer-base")
    p.add_argument("--attention", default="mha")
    p.add_argument("--data", default="multi30k", help="multi30k or wmt14")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--data-dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true")


@command("train-mt", "train the encoder-decoder on parallel text; BLEU with sacrebleu", _mt_args)
def cmd_train_mt(args) -> int:
    # the languages go in first, so a user's --set data.task_options.src=... wins
    cfg = build_run("mt", args, task_options={"src": args.src, "tgt": args.tgt})
    o = cfg.data.task_options
    out = args.out or str(default_run_dir("mt", cfg.data.dataset, f"{o.src}-{o.tgt}", cfg.preset, cfg.model.attention))
    res = run_training(cfg, out, args.resume)
    keys = ("status", "step", "attention", "bleu", "bleu_last5_mean", "signature", "attention_params", "out")
    print(json.dumps({k: res[k] for k in keys if k in res}, indent=2))
    return exit_status(res)


def _translate_args(p):
    p.add_argument("--checkpoint", required=True, help="a translation run directory")
    p.add_argument("--input", default="-", help="a file of source lines (default: stdin)")
    p.add_argument("--beam", type=int, default=None)
    p.add_argument("--alpha", type=float, default=None, help="length penalty")


@command("translate", "translate lines with a trained model (stdin or --input)", _translate_args)
def cmd_translate(args) -> int:
    import math

    from mhe.checkpoint_io import load_run

    if args.beam is not None and args.beam <= 0:
        raise MheError(f"--beam must be a positive integer (1 is greedy), got {args.beam}")
    if args.alpha is not None and not (math.isfinite(args.alpha) and args.alpha >= 0):
        raise MheError(f"--alpha must be a finite length penalty >= 0, got {args.alpha}")
    if args.input != "-" and not Path(args.input).is_file():
        raise MheError(f"input file not found: {args.input}")
    lines = read_source_lines(args.input)  # before the model loads: bad input fails at once
    model, cfg, task = load_run(args.checkpoint, inference=True)  # the run folder alone: no corpus
    if cfg.task != "mt":
        raise MheError(f"{args.checkpoint} is a {cfg.task!r} run, not a translation run")
    for hyp in task.translate(model, lines, beam=args.beam, alpha=args.alpha, progress=cfg.train.progress):
        print(hyp)
    return 0


def read_source_lines(source: str) -> list[str]:
    """Lines of a UTF-8 file (plain, gzip or xz) or, for ``-``, of standard input; a byte
    that is not UTF-8 is an error naming the line and byte offset."""
    from mhe.data.paths import iter_lines

    if source != "-":
        return [line.rstrip("\n") for line in iter_lines(source)]
    lines, offset = [], 0
    for n, raw in enumerate(sys.stdin.buffer, 1):
        try:
            lines.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as e:
            raise MheError(f"standard input: line {n}: byte {offset + e.start} (0x{raw[e.start]:02x}) is not "
                           "UTF-8; the input must be UTF-8 text") from None
        offset += len(raw)
    return lines


def _finetune_args(p):
    p.add_argument("--task", required=True, help="rte, mrpc, cola, sst2, stsb, qnli, qqp, mnli, mnli-mm, boolq, cb, "
                                                 "sg-rte, wic, multirc, copa, wsc, squad, squad-v2")
    p.add_argument("--checkpoint", required=True, help="the pre-training run directory")
    p.add_argument("--seeds", type=int, default=1, help="run this many seeds and report mean and std")
    p.add_argument("--data-dir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--resume", action="store_true")


def finetune_config(task: str, checkpoint: str, *, data_dir: str = "", overrides=(), seed: int = 0):
    from mhe.data.benchmarks import bench_task
    from mhe.models import preset
    from mhe.training.config import DataConfig, RunConfig, apply_overrides
    from mhe.training.defaults import finetune_train
    from mhe.training.run_files import read_run_config

    bench_task(task)
    pre = read_run_config(checkpoint)
    # the model itself comes from the checkpoint; model.* settings here change it from the preset
    cfg = RunConfig(task="finetune", preset=pre.preset, model=preset(pre.preset).replace(attention=pre.kind),
                    train=finetune_train(task),
                    data=DataConfig(dataset=task, data_dir=data_dir,
                                    task_options={"task": task, "checkpoint": str(checkpoint)}))
    cfg = apply_overrides(cfg, list(overrides))
    cfg.train.seed = seed
    return cfg


@command("finetune", "fine-tune a pre-trained run on GLUE, SuperGLUE or SQuAD", _finetune_args)
def cmd_finetune(args) -> int:
    from mhe.training.loop import DONE
    from mhe.training.run_files import RESULTS, is_run_dir, read_results

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
            _print_result(res)
            return exit_status(res)
        results.append(res)
    scores = [r["score"] for r in results]
    import statistics

    summary = {"task": args.task, "metric": results[0]["metric"], "attention": results[0]["attention"],
               "scores": scores, "mean": statistics.fmean(scores),
               "std": statistics.stdev(scores) if len(scores) > 1 else 0.0, "n_seeds": len(scores)}
    from mhe.experiments.summary import metric_means

    summary["metrics"] = metric_means(results)  # every official metric; `metric` is the paper's headline
    if args.seeds > 1:
        from mhe.training.checkpoint import write_json_atomic

        write_json_atomic(out / "summary.json", summary)
    print(json.dumps(summary, indent=2))
    return 0
