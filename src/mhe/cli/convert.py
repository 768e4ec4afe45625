"""``mhe convert``: a trained multi-head model (a run folder or a Hugging Face checkpoint
directory) as another attention kind, written as a run folder that ``mhe eval``, ``generate``,
``finetune`` and ``pretrain --init-from`` take (:mod:`mhe.convert`)."""

from __future__ import annotations

import sys
from pathlib import Path

from mhe.convert.options import FITS, MINIMISES, SPLITS, TARGETS, check_request, parse_option_sets, target_spec
from mhe.errors import MheError
from mhe.experiments.tables import print_table
from mhe.output_paths import check_empty_out, default_run_dir
from mhe.progress import quiet_library_bars


def convert_args(p):
    p.add_argument("--checkpoint", required=True,
                   help="the model to convert: a run folder (with config.json) or a Hugging Face checkpoint "
                        "directory (GPT-2 LM, BERT MLM, or a Llama, Qwen2 or Mistral causal LM, as mhe.hf.import_hf "
                        "reads)")
    p.add_argument("--attention", required=True, help=f"the kind to convert to: {', '.join(TARGETS)}")
    p.add_argument("--n-kv-heads", type=int, default=0,
                   help="K/V heads of a gqa target (default: n/4, the largest divisor of the head count not above it)")
    p.add_argument("--set", action="append", default=[], metavar="model.attn_options.KEY=VALUE",
                   help="an option of the target kind (repeatable), e.g. model.attn_options.rope_order=psi-then-rope "
                        "for MHE under rotary positions (default rope-then-psi: the head embeddings act after the "
                        "rotation, one K/V head cached); the fit honours it")
    p.add_argument("--out", default="", help="the run folder to write (default runs/convert-SOURCE-KIND); "
                                             "must not exist or be empty")
    p.add_argument("--no-align", dest="align", action="store_false",
                   help="fit the heads as they are; by default each head's query/key and value/output dimensions "
                        "are first rotated towards the fit (Procrustes: the source's function is unchanged and the "
                        "fit's error can only fall; MQA/GQA without it is Ainslie et al.'s mean pooling)")
    p.add_argument("--naive", action="store_true",
                   help="write the naive initialisation instead of the fit: the mean of the heads, head "
                        "embeddings zero (the baseline the report compares with)")
    p.add_argument("--fit", default="weights", choices=FITS,
                   help="weights (default): the least-squares fit of the weights; outputs: then fit each attention "
                        "sublayer to the source sublayer's outputs on the calibration sequences (a short Adam "
                        "descent on all its parameters, layer by layer with the source's inputs), kept per sublayer "
                        "only where its error on held-out calibration sequences is below the weight fit's")
    p.add_argument("--fit-steps", type=int, default=200,
                   help="Adam steps per sublayer of --fit outputs, one calibration batch each (default 200)")
    p.add_argument("--fit-lr", type=float, default=1e-3, help="learning rate of --fit outputs (default 1e-3)")
    p.add_argument("--no-eval", dest="evaluate", action="store_false",
                   help="skip scoring the source and the converted model (no corpus is read unless calibrating)")
    p.add_argument("--split", default=None, choices=SPLITS,
                   help="the held-out split scored before and after conversion (default valid)")
    p.add_argument("--calibration", type=int, default=32,
                   help="training sequences whose attention inputs fit MHE-Add's head offsets and measure the "
                        "error on projected outputs (default 32; 0: weight space only)")
    p.add_argument("--data", default="",
                   help="the corpus to score and calibrate on (default: the run's own; for a Hugging Face directory "
                        "ptb, wikitext-2, wikitext-103 or offline-english, and without it the directory is converted "
                        "without scoring or calibration)")
    p.add_argument("--tokenizer", default="",
                   help="for a Hugging Face directory: a tokenizer folder (as transformers saves one) or a run folder "
                        "whose tokenizer it uses (default: the directory's own; without any, the converted run holds "
                        "the model's vocabulary as ids only)")
    p.add_argument("--data-dir", default="", help="data folder (default: $MHE_DATA or ../shared/data)")
    p.add_argument("--device", default="auto", help="where scoring and calibration run: auto (a GPU if any), cpu, cuda")


def cmd_convert(args) -> int:
    target = target_spec(args.attention)  # the one parse of --attention; its spec goes down
    out = args.out or str(default_run_dir("convert", Path(args.checkpoint).resolve().name, target.name))
    options = parse_option_sets(target, args.set)  # before anything is read
    ignored_options(args, target)
    check_request(args.checkpoint, target, args.n_kv_heads)  # before torch and any weights
    check_empty_out(out)
    quiet_library_bars()  # transformers' loading bars only on a terminal
    from mhe.convert.outputs import OutputFit
    from mhe.convert.runs import ConvertOptions, convert_run

    fit = OutputFit(steps=args.fit_steps, lr=args.fit_lr)  # checked before anything is read
    opts = ConvertOptions(kind=target, n_kv_heads=args.n_kv_heads, options=options, align=args.align,
                          naive=args.naive, output_fit=fit if args.fit == "outputs" else None, evaluate=args.evaluate,
                          split=args.split or "valid", calibration=args.calibration,
                          data=args.data, data_dir=args.data_dir, device=args.device, tokenizer=args.tokenizer)
    report = convert_run(args.checkpoint, out, opts, log=lambda m: print(m, file=sys.stderr))
    what = "naive initialisation" if args.naive else "fit"
    print(f"{report.source} -> {report.kind}: relative reconstruction error per sublayer, the {what} beside the "
          "mean of the heads (logits: each head's query-key form; value-output: its value-to-output map); "
          f"the fit minimises the {MINIMISES[report.kind]}")
    if report.options.get("rotary"):
        print(report.options["rotary"] + " (under RoPE the logits and weight-space errors are those at zero relative "
              "distance)")
    print_table(*report.error_table("weight"))
    if report.has_output_errors():
        print(f"\nthe same on the projected outputs of {report.options['calibration_tokens']:,} calibration tokens:")
        print_table(*report.error_table("output"))
    _print_output_fit(report)
    if report.scores:
        src, conv = report.scores["source"], report.scores["converted"]
        metric = src["metric"] + (f" per {src['perplexity_per']}" if "perplexity_per" in src else "")
        print(f"\n{metric} on the {src['split']} split, before any training:")
        print_table(["model", "attention", metric], [["source", report.source, f"{src['score']:.4g}"],
                                                     ["converted", report.kind, f"{conv['score']:.4g}"]])
    else:
        print(f"\nnot scored: {report.options.get('not_scored', '--no-eval')}")
    print(f"\nwrote {out}")
    return 0


def _print_output_fit(report) -> None:
    """The output fit's held-out errors per sublayer, beside the weight fit's (--fit outputs)."""
    fit = report.options.get("output_fit")
    if not fit:
        return
    print(f"\noutput fit ({fit['steps']} Adam steps a sublayer, lr {fit['lr']:g}): relative error of the sublayer's "
          "output on held-out calibration sequences, and the fit kept")
    print_table(["sublayer", "weight fit (%)", "output fit (%)", "kept"],
                [[r["sublayer"], f"{100 * r['weight_fit']:.2f}", f"{100 * r['output_fit']:.2f}", r["kept"]]
                 for r in fit["layers"]])


def ignored_options(args, target) -> None:
    """Options the chosen conversion would not use: refused where they change what the user
    expects to get (``--split`` with ``--no-eval``: no score at all), noted on standard error where
    harmless (``--no-align`` where nothing is aligned: the naive initialisation, or an sha
    ``target``, the spec of ``--attention``)."""
    if args.split is not None and not args.evaluate:
        raise MheError(f"--split {args.split} names the split scored, and --no-eval scores none: drop one of them")
    if not args.align and (args.naive or target.single_head):
        why = "--naive writes the mean of the heads" if args.naive else "sha's fit does not depend on rotations"
        print(f"note: --no-align changes nothing here ({why}, nothing is aligned)", file=sys.stderr)
