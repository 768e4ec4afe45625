"""Training commands: ``mhe train``, ``mhe pretrain``, ``mhe train-mt``, ``mhe finetune`` and
``mhe run``. Each builds a typed ``RunConfig`` (``mhe.tasks.build_run``: the task's defaults, then the options) and hands it to
``mhe.tasks.runs.run_training``."""

from __future__ import annotations

import json
import statistics

from mhe.cli.common import DATA_DIR_HELP, add_run_folder_arg, refuse_set_keys
from mhe.data.benchmarks import finetuning_tasks
from mhe.data.corpora import corpus, corpus_names
from mhe.data.parallel_text import PARALLEL
from mhe.errors import MheError, one_of
from mhe.models import preset
from mhe.models.config import family_preset
from mhe.output_paths import check_output_dir, default_run_dir
from mhe.tasks.catalogue import CATALOGUE, build_run, read_run_config, read_run_config_file, train_tasks
from mhe.tasks.finetune_config import default_finetune_dir, finetune_config
from mhe.tasks.run_tokenizer import refuse_ids_only_run, run_source
from mhe.training.run_files import is_run_dir, require_run_dir

PRETRAIN_TASK = {"decoder": "lm", "encoder": "mlm"}  # the objective of each architecture (section 4.1)


def add_set_args(p) -> None:
    """``--set`` and ``--resume``, shared by every command that trains."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting (repeatable), e.g. train.lr=3e-4, train.steps=200, model.dropout=0")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")


def add_run_args(p, *, task_choice: bool, preset_default: str | None = None, data_help: str = "",
                 out_help: str = "runs/TASK-DATA-PRESET-KIND", from_source: bool = False) -> None:
    """The options every single-run training command shares (``from_source``: preset and kind
    may come from the run given by ``--init-from``)."""
    if task_choice:
        p.add_argument("--task", required=True,
                       help="; ".join(f"{n}: {CATALOGUE[n].summary}" for n in train_tasks()))
    data_help = data_help or f"corpus: {corpus_names()}"
    if from_source:
        p.add_argument("--preset", default=None, help="model preset (tiny-decoder, gpt2-base, bert-base, ...); "
                                                      "with --init-from: default the source run's")
    elif preset_default is None:
        p.add_argument("--preset", required=True, help="model preset (tiny-decoder, gpt2-base, bert-base, ...)")
    else:
        p.add_argument("--preset", default=preset_default, help=f"model preset (default {preset_default})")
    p.add_argument("--attention", default=None,
                   help="attention kind (mha, mhe-mul, ...): sets model.attention (default mha"
                        + ("; with --init-from: the source run's kind)" if from_source else ")"))
    p.add_argument("--data", default=None, help=data_help)  # a command with a default fills it in
    p.add_argument("--data-dir", default="", help=DATA_DIR_HELP)
    p.add_argument("--out", default="", help=f"run folder (default {out_help})")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: train.seed, 0)")
    add_set_args(p)


def given_flags(args) -> dict[str, tuple[str, object]]:
    """The settings this command line's options gave explicitly (key -> the option as typed):
    a ``--set`` item of the same key must agree (:func:`mhe.tasks.catalogue.check_flags_agree`)."""
    named = {"train.seed": ("--seed", args.seed), "model.attention": ("--attention", args.attention),
             "data.dataset": ("--data", args.data or None),
             "data.task_options.src": ("--src", getattr(args, "src", None)),
             "data.task_options.tgt": ("--tgt", getattr(args, "tgt", None))}
    return {key: (flag, value) for key, (flag, value) in named.items() if value is not None}


def _run_from_args(task: str, args, task_options: dict | None = None, flags: dict | None = None):
    """The run's checked configuration (no torch yet: a setting's error comes at once)."""
    return build_run(task, args.preset, attention=args.attention or "mha", data=args.data or "", data_dir=args.data_dir,
                     seed=args.seed, overrides=args.set, task_options=task_options,
                     flags=given_flags(args) if flags is None else flags)


def print_result(res: dict) -> None:
    keys = [k for k in ("status", "step", "task", "attention", "metric", "split", "score", "perplexity",
                        "perplexity_per", "tokenizer", "word_perplexity", "accuracy", "mlm_accuracy",
                        "attention_params", "out")
            if k in res]
    print(json.dumps({k: res[k] for k in keys}, indent=2))


def train_args(p):
    add_run_args(p, task_choice=True)


def cmd_train(args) -> int:
    if args.task in CATALOGUE and CATALOGUE[args.task].command != "train":
        raise MheError(f"task {args.task!r} has its own command: mhe {CATALOGUE[args.task].command}")
    if args.task not in CATALOGUE:
        raise one_of("task", args.task, train_tasks())
    cfg = _run_from_args(args.task, args)
    from mhe.tasks.runs import exit_status, run_training  # torch: only once the settings hold

    res = run_training(cfg, args.out, args.resume)
    print_result(res)
    return exit_status(res)


def pretrain_args(p):
    add_run_args(p, task_choice=False, from_source=True)
    p.add_argument("--init-from", default="", metavar="RUN",
                   help="continue pre-training (or uptrain a converted run, mhe convert): start from RUN's weights, "
                        "tokenizer and model settings, with a fresh optimiser and a warm-up of 5%% of the steps "
                        "unless train.warmup_* is set")


def refuse_unsized_uptraining(run: str, items: list[str], steps: int) -> None:
    """Refuse uptraining a converted run (``mhe convert``) without ``train.steps`` or
    ``train.epochs``: the default schedule is a pre-training's (``steps`` long, a million for the
    full-sized presets), not an uptraining's of a few percent of that (issue 58)."""
    if not run_source(require_run_dir(run, "--init-from")):
        return
    if {i.split("=", 1)[0].strip() for i in items} & {"train.steps", "train.epochs"}:
        return
    raise MheError(f"--init-from {run} is a conversion: say how long to uptrain it with --set train.steps=N (or "
                   f"train.epochs=N); the default, {steps:,} steps, is a pre-training schedule")


def cmd_pretrain(args) -> int:
    source = read_run_config(require_run_dir(args.init_from, "--init-from")) if args.init_from else None
    if source is not None:  # before torch: an ids-only conversion cannot read the corpus (issue 58)
        refuse_ids_only_run(args.init_from, "--init-from", doing="encode the text of --data")
    given, flags = {"preset": args.preset, "attention": args.attention}, given_flags(args)
    if source is not None:  # the source's model; what was given is compared with it (continued_run)
        # a source of no preset (a converted checkpoint) takes its family's conventions (schedule, warm-up)
        args.preset, args.attention = source.preset or family_preset(source.model), source.kind
    if args.preset is None:
        raise MheError("pretrain needs --preset (tiny-decoder, gpt2-base, bert-base, ...) or --init-from RUN")
    args.attention = args.attention or "mha"
    task = PRETRAIN_TASK.get((source.model if source is not None else preset(args.preset)).arch)
    if task is None:
        raise MheError(f"pretrain takes an encoder or decoder preset; {args.preset!r} is an encoder-decoder "
                       "(train it with translation)")
    if not args.data:
        raise MheError(f"pretrain needs --data ({corpus_names()})")
    corpus(args.data)  # a corpus of that name (its files are the task's check, with torch)
    cfg = _run_from_args(task, args, flags=flags)
    from mhe.tasks.init_from import continued_run  # torch: only once the settings hold
    from mhe.tasks.runs import exit_status, run_training

    if source is not None:
        cfg = continued_run(cfg, source, args.set, run=args.init_from, **given)  # the model's differences first
        cfg.preset = source.preset  # "" for a converted checkpoint: its sizes are its own
        refuse_unsized_uptraining(args.init_from, args.set, cfg.train.steps)
        cfg.train.init_from = str(args.init_from)
    res = run_training(cfg, args.out, args.resume)
    print_result(res)
    return exit_status(res)


def train_mt_args(p):
    add_run_args(p, task_choice=False, preset_default="transformer-base",
                 data_help=f"parallel corpus: {', '.join(PARALLEL)} (default multi30k)",
                 out_help="runs/mt-DATA-SRC-TGT-PRESET-KIND")
    p.add_argument("--src", default=None, help="source language code (default en)")
    p.add_argument("--tgt", default=None, help="target language code (default de)")


def cmd_train_mt(args) -> int:
    # the languages given go in first; a --set data.task_options.src=... that disagrees is refused
    langs = {k: v for k, v in (("src", args.src), ("tgt", args.tgt)) if v is not None}
    flags = given_flags(args)
    args.data = args.data or "multi30k"
    cfg = _run_from_args("mt", args, task_options=langs, flags=flags)
    from mhe.tasks.runs import exit_status, run_training  # torch: only once the settings hold

    o = cfg.data.task_options
    out = args.out or str(default_run_dir("mt", cfg.data.dataset, f"{o.src}-{o.tgt}", cfg.preset, cfg.model.attention))
    res = run_training(cfg, out, args.resume)
    keys = ("status", "step", "attention", "bleu", "bleu_last5_mean", "signature", "attention_params", "out")
    print(json.dumps({k: res[k] for k in keys if k in res}, indent=2))
    return exit_status(res)


def finetune_args(p):
    p.add_argument("--task", required=True, help=f"benchmark task. {finetuning_tasks()}")
    add_run_folder_arg(p, "the pre-training run folder (one that holds config.json), or one of its "
                          "checkpoints/step-N folders")
    p.add_argument("--seeds", type=int, default=1, help="run this many seeds and report mean and std (default 1)")
    p.add_argument("--data-dir", default="", help=DATA_DIR_HELP)
    p.add_argument("--out", default="", help="run folder (default runs/finetune-TASK-RUN-HASH, HASH naming the "
                                             "pre-training run, so different ones never share a folder)")
    add_set_args(p)


def cmd_finetune(args) -> int:
    if args.seeds <= 0:
        raise MheError(f"--seeds must be positive, got {args.seeds}")
    refuse_set_keys(args.set, {"train.seed": f"--seeds {args.seeds} (seeds 0 to {args.seeds - 1})"})
    if args.out:
        check_output_dir(args.out)
    # every seed's configuration (and the pre-training run) is checked before any folder is made
    configs = [finetune_config(args.task, args.run, data_dir=args.data_dir, overrides=args.set, seed=seed)
               for seed in range(args.seeds)]
    out = check_output_dir(args.out or default_finetune_dir(args.task, args.run))
    if args.resume and not out.is_dir():
        raise MheError(f"--resume: there is no run in {out}; drop --resume to start one")
    if args.seeds > 1 and is_run_dir(out):
        raise MheError(f"{out} holds a single-seed run; choose another --out for {args.seeds} seeds")
    from mhe.experiments.summary import metric_means  # torch: only once the settings hold
    from mhe.tasks.runs import exit_status, run_training
    from mhe.training.checkpoint import write_json_atomic
    from mhe.training.loop import DONE

    results = []
    for seed, cfg in enumerate(configs):
        run_dir = out / f"seed-{seed}" if args.seeds > 1 else out
        # with several seeds, --resume continues the seeds that started and starts the others
        resume = args.resume and (args.seeds == 1 or is_run_dir(run_dir))
        res = run_training(cfg, str(run_dir), resume)
        if res["status"] not in DONE:
            print_result(res)
            return exit_status(res)
        results.append(res)
    scores = [r["score"] for r in results]
    summary = {"task": args.task, "metric": results[0]["metric"], "attention": results[0]["attention"],
               "scores": scores, "mean": statistics.fmean(scores), "n_seeds": len(scores), "out": str(out)}
    if len(scores) > 1:  # a spread needs more than one seed
        summary["std"] = statistics.stdev(scores)
    summary["metrics"] = metric_means(results)  # every official metric; `metric` is the paper's headline
    if args.seeds > 1:
        write_json_atomic(out / "summary.json", summary)
    print(json.dumps(summary, indent=2))
    return 0


def run_args(p):
    p.add_argument("--config", required=True, help="a run.json written by mhe compare")
    p.add_argument("--out", required=True, help="the run folder to train into")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")


def cmd_run(args) -> int:
    from mhe.training.config import check_device

    cfg = read_run_config_file(args.config)  # checks every setting
    check_device(cfg.train.device)
    from mhe.tasks.runs import exit_status, run_training  # torch: only once the settings hold
    from mhe.training.loop import DONE

    res = run_training(cfg, args.out, args.resume)
    if res["status"] in DONE:
        return 0
    return exit_status(res) or 3  # interrupted: 130/143; stopped early by train.stop_at: 3
