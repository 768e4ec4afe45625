"""``mhe export``: a trained run as a folder anyone with transformers can load.

``--format remote-code`` (default) writes the model with its own modeling code (loads with
``trust_remote_code=True`` where mhe is not installed); ``--format standard`` writes a standard
transformers architecture where one holds the model exactly and refuses otherwise, naming
``--format remote-code``. Both carry the run's tokenizer and a model card
(:func:`mhe.tasks.hf_runs.export_run`). transformers is imported only when the command runs.
"""

from __future__ import annotations

import os
from pathlib import Path

from mhe.cli.common import add_run_folder_arg
from mhe.errors import MheError
from mhe.output_paths import check_output_dir
from mhe.progress import quiet_library_bars
from mhe.training.run_files import locate_run

FORMATS = ("remote-code", "standard")


def export_args(p):
    add_run_folder_arg(p, "a run folder (its best weights, else its newest checkpoint), or one of its "
                          "checkpoints/step-N folders")
    p.add_argument("--out", required=True, help="the new folder to write (absent or empty)")
    p.add_argument("--format", choices=FORMATS, default="remote-code",
                   help="remote-code: the folder carries its modeling code (any model); standard: Llama/Qwen2/"
                        "Mistral, GPT-2, BERT or GPTBigCode, where one holds the model exactly (default remote-code)")
    p.add_argument("--family", choices=("llama", "qwen2", "mistral"), default=None,
                   help="--format standard, Llama-style decoders: the class to write (default: from the biases)")
    p.add_argument("--data-dir", default="", help="where the run's data is, for tasks that set up from their corpus")


def cmd_export(args) -> int:
    out = check_output_dir(args.out, temp=f".{Path(args.out).name}.partial-{os.getpid()}")  # the folder the
    # write fills (mhe.hf.export.partial_path), tried before torch: path errors answer at once
    if out.exists() and any(out.iterdir()):
        raise MheError(f"--out {out} already exists and is not an empty folder; choose a new folder")
    locate_run(args.run)
    quiet_library_bars()  # transformers' writing bars only on a terminal
    from mhe.tasks.hf_runs import export_run

    out = export_run(args.run, args.out, format=args.format, family=args.family, data_dir=args.data_dir)
    print(f"wrote {out} ({args.format}): load it with transformers' Auto classes"
          + (" and trust_remote_code=True" if args.format == "remote-code" else ""))
    return 0
