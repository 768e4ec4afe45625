"""The ``mhe`` command: one table of subcommands, each a parser-building function and a run
function from one of this package's modules. Nothing outside this package imports it.

``mhe`` with no arguments prints the command list and exits 0 (a request for help, as
``git`` or ``pip`` with no command is); an unknown command or option exits 2, like every
other bad input (one line, no traceback). The main job is ``mhe compare``.

A command's module is imported only when that command is parsed or run (:func:`lazy`), so
``mhe``, ``mhe --help`` and an unknown command answer without importing torch, and ``mhe
params`` without the training, data and Hugging Face packages (``tests/cli/test_cli_imports.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
from typing import Callable, NamedTuple

from mhe.errors import MheError
from mhe.runtime import check_launch_env, configure_threads_on_import, launched_rank, setting_threads


def lazy(module: str, name: str) -> Callable:
    """``mhe.cli.MODULE.NAME``, imported on the first call (the command table names every
    command's functions without importing their modules)."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"mhe.cli.{module}"), name)(*args, **kwargs)

    call.__name__ = call.__qualname__ = name
    return call


class Command(NamedTuple):
    """One subcommand: its one-line summary, the function that adds its options, the function
    that runs it (returns the exit status) and an example shown at the end of its ``--help``."""

    summary: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    example: str
    torch: bool = True  # False: the command needs no torch (its threads are not configured)


COMMANDS: dict[str, Command] = {
    # model accounting (no training)
    "params": Command("attention parameters per kind (Tables 1-4, Appendix D)",
                      lazy("accounting", "params_args"), lazy("accounting", "cmd_params"),
                      "mhe params --preset bert-base --exclude-output", torch=False),
    "memory": Command("Appendix C's memory table per attention block",
                      lazy("accounting", "memory_args"), lazy("accounting", "cmd_memory"),
                      "mhe memory --preset bert-base --batch 32 --seq-len 512", torch=False),
    "scaling": Command("Figures 1/3/4 and the GPT-3 projection of section 5.4",
                       lazy("accounting", "scaling_args"), lazy("accounting", "cmd_scaling"),
                       "mhe scaling --head-dim 64 --plot scaling.png", torch=False),
    # comparisons (the main job)
    "compare": Command("train every attention kind the same way and compare them (the main job)",
                       lazy("compare", "compare_args"), lazy("compare", "cmd_compare"),
                       "mhe compare --preset cpu-recall\n  mhe compare --preset cpu-ptb --kinds mha,mhe-mul --seeds 1"),
    "report": Command("rebuild tables and plots from finished comparison runs",
                      lazy("compare", "report_args"), lazy("compare", "cmd_report"),
                      "mhe report runs/compare-cpu-ptb --paper table2-ptb"),
    "overview": Command("one table over several comparisons: per-task means, their average, PRR and PEoP",
                        lazy("compare", "overview_args"), lazy("compare", "cmd_overview"),
                        "mhe overview results/encoder-* --out overview.md"),
    # single runs
    "train": Command("train a model on a task (lm, mlm, recall) with the shared engine",
                     lazy("training", "train_args"), lazy("training", "cmd_train"),
                     "mhe train --task recall --preset tiny-decoder --attention mhe-mul --set train.steps=200"),
    "pretrain": Command("pre-train: causal LM for decoder presets, masked LM for encoder presets",
                        lazy("training", "pretrain_args"), lazy("training", "cmd_pretrain"),
                        "mhe pretrain --preset tiny-decoder --data ptb --attention mhe-mul"),
    "finetune": Command("fine-tune a pre-trained run on GLUE, SuperGLUE or SQuAD",
                        lazy("training", "finetune_args"), lazy("training", "cmd_finetune"),
                        "mhe finetune --task rte --run runs/mlm-wikitext-2-tiny-encoder-mha --seeds 5"),
    "train-mt": Command("train the encoder-decoder on parallel text; BLEU with sacrebleu",
                        lazy("training", "train_mt_args"), lazy("training", "cmd_train_mt"),
                        "mhe train-mt --preset tiny-encoder-decoder --data multi30k --attention mhe-add"),
    "run": Command("train one run from a saved configuration (used by mhe compare's workers)",
                   lazy("training", "run_args"), lazy("training", "cmd_run"),
                   "mhe run --config runs/compare-cpu-recall/runs/mha-seed0/run.json "
                   "--out runs/compare-cpu-recall/runs/mha-seed0 --resume"),
    # using a trained run
    "eval": Command("evaluate a trained run (language models: sliding-window perplexity)",
                    lazy("evaluation", "eval_args"), lazy("evaluation", "cmd_eval"),
                    "mhe eval --run runs/lm-ptb-tiny-decoder-mha --split test"),
    "translate": Command("translate lines with a trained model (stdin or --input)",
                         lazy("evaluation", "translate_args"), lazy("evaluation", "cmd_translate"),
                         "echo 'a man rides a bike .' | mhe translate "
                         "--run runs/mt-multi30k-en-de-tiny-encoder-decoder-mha --beam 4"),
    "generate": Command("continue prompts with a trained language-model run (greedy or sampled)",
                        lazy("generate", "generate_args"), lazy("generate", "cmd_generate"),
                        "mhe generate --run runs/lm-ptb-tiny-decoder-mha --prompt 'the company said' "
                        "--max-new-tokens 20"),
    "diagnostics": Command("SuperGLUE diagnostics AX-b (Matthews corr.) and AX-g (accuracy, gender parity) "
                           "with an RTE run",
                           lazy("evaluation", "diagnostics_args"), lazy("evaluation", "cmd_diagnostics"),
                           "mhe diagnostics --run runs/finetune-rte-mlm-wikitext-2-tiny-encoder-mha-3f09a2 "
                           "--out submission"),
    "convert": Command("convert a trained multi-head model (run folder or Hugging Face directory) to MQA, GQA, "
                       "MHE or SHA, fitted, as a run folder to uptrain",
                       lazy("convert", "convert_args"), lazy("convert", "cmd_convert"),
                       "mhe convert --checkpoint runs/lm-ptb-tiny-decoder-mha --attention mhe-mul "
                       "--out runs/ptb-mhe-mul"),
    "export": Command("write a trained run as a folder transformers loads without mhe (its own modeling code, "
                      "or a standard architecture where one holds it exactly)",
                      lazy("export", "export_args"), lazy("export", "cmd_export"),
                      "mhe export --run runs/lm-ptb-tiny-decoder-mhe-mul --out tiny-mhe-mul"),
    # speed
    "bench": Command("time every attention kind side by side on this device",
                     lazy("bench", "bench_args"), lazy("bench", "cmd_bench"),
                     "mhe bench --sections attn,decode --kinds mha,mqa,mhe-mul"),
}


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line (``mhe CMD: error: ...``) and exit code 2, like every
    other bad input; ``--help`` still prints the full usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n" if _speaks() else None)


def _speaks() -> bool:
    """Whether this process prints errors: under torchrun every rank meets the same bad input,
    and rank 0 alone says so (the exit status is 2 on every rank)."""
    return os.environ.get("RANK", "0") == "0"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``mhe`` parser with one subparser per entry of :data:`COMMANDS`; with ``only``, the
    options of that command alone (the others listed, their modules not imported)."""
    parser = OneLineParser(prog="mhe", description="Multi-head embedding attention toolkit",
                           epilog="Run 'mhe COMMAND --help' for a command's options and an example.\n"
                                  "Example:\n  mhe compare --preset cpu-recall",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        p = sub.add_parser(name, help=cmd.summary, description=cmd.summary, epilog=f"Example:\n  {cmd.example}",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if only is None or name == only:
            cmd.add_args(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``mhe`` with ``argv`` (default: the process's arguments); returns the exit status:
    0 done, 2 bad input, 130/143 interrupted by SIGINT/SIGTERM after saving."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(only=next((a for a in argv if not a.startswith("-")), ""))
    if not argv:
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if COMMANDS[args.command].torch:
        try:
            note = check_launch_env()  # WORLD_SIZE/RANK without the rest: no torchrun, every process says so
            if note:
                print(f"mhe {args.command}: note: {note}", file=sys.stderr)
        except MheError as e:
            print(f"mhe {args.command}: error: {e}", file=sys.stderr)
            return 2
    try:
        setting_threads()  # MHE_THREADS: one setting for every command, checked first (mhe.runtime)
        if COMMANDS[args.command].torch:
            configure_threads_on_import()  # applied when torch loads: a setting's error comes before it
        # under torchrun only rank 0 prints results (messages and errors still go to standard error)
        with open(os.devnull, "w") if launched_rank() else contextlib.nullcontext() as sink, \
                contextlib.redirect_stdout(sink) if sink else contextlib.nullcontext():
            return int(COMMANDS[args.command].run(args) or 0)
    except MheError as e:
        if _speaks():
            print(f"mhe {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"mhe {args.command}: interrupted", file=sys.stderr)
        return getattr(e, "exit_code", 130)  # RunInterrupted carries 128 + its signal
