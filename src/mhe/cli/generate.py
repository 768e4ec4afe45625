"""``mhe generate``: continue prompts with a trained language-model run.

Loads the run's model and tokenizer from the run folder alone (``tasks.runs.load_run`` with
``inference=True``), left-pads the prompts into one batch and calls the fast generation path
(``DecoderForCausalLM.generate``: static KV cache, CUDA-graph decode step on a GPU, MHE folded
to MQA). Each prompt starts a new line of the training stream (after ``[EOS]``); a
continuation ends at ``[EOS]`` (the end of a line). Why each continuation ended (the end
token, or ``--max-new-tokens``) goes to standard error, one line per prompt.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mhe.cli.common import add_decode_step_args, add_run_folder_arg, compile_options
from mhe.data.paths import read_source_lines
from mhe.data.tokenize import special_id
from mhe.errors import MheError


def generate_args(p):
    add_run_folder_arg(p, "a language-model run folder (mhe pretrain with a decoder preset), or one of its "
                          "checkpoints/step-N folders")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--input", default="", help="a file of prompts, one a line ('-' = stdin)")
    p.add_argument("--max-new-tokens", type=int, default=50,
                   help="at most this many tokens after each prompt (default 50)")
    p.add_argument("--min-new-tokens", type=int, default=0,
                   help="the end token cannot end a continuation before this many new tokens (default 0)")
    p.add_argument("--sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample from the smallest set of tokens whose probability reaches p (default 1.0: all)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (same seed, same text)")
    p.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    p.add_argument("--data-dir", default="", help="ignored: generation reads only the run folder (kept so that "
                                                  "the options of mhe eval also work here)")
    add_decode_step_args(p)


def read_prompts(prompts: list[str], source: str) -> list[str]:
    out = list(prompts)
    if source and source != "-" and not Path(source).is_file():
        raise MheError(f"--input {source} does not exist")
    if source:  # UTF-8 (plain, gzip or xz); another byte is one line naming it, as mhe translate says
        out += read_source_lines(source)
    if not out:
        raise MheError("give at least one --prompt, or --input FILE ('-' for stdin)")
    return out


def cmd_generate(args) -> int:
    import torch

    from mhe.models.generate import left_pad
    from mhe.tasks.runs import load_run

    prompts = read_prompts(args.prompt, args.input)
    step_options = compile_options(args.compile_options)  # before the model loads: bad input fails at once
    if args.stream and len(prompts) != 1:
        raise MheError(f"--stream prints one continuation as it comes; got {len(prompts)} prompts")
    # the run's type first, then the run folder alone (its tokenizer and weights): no corpus is read
    model, cfg, task = load_run(args.run, inference=True, tasks=("lm",),
                                needs="mhe generate needs a language-model (lm) run")
    tok = task.tok
    eos, pad = special_id(tok, "[EOS]"), tok.token_to_id("[PAD]")
    pad = eos if pad is None else pad  # a converted decoder without a pad token: masked positions only
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(dev)
    ids, mask = left_pad([[eos] + tok.encode(p, add_special_tokens=False).ids for p in prompts], pad)
    streamer = None
    if args.stream:
        print(prompts[0], end="", flush=True)
        streamer = lambda new: new[0] != eos and print(" " + tok.decode([new[0]]), end="", flush=True)  # noqa: E731
    res = model.generate(ids.to(dev), args.max_new_tokens, attention_mask=mask.to(dev), stop_ids=[eos], pad_id=pad,
                         min_new_tokens=args.min_new_tokens, do_sample=args.sample, temperature=args.temperature,
                         top_k=args.top_k, top_p=args.top_p, seed=args.seed, streamer=streamer, return_dict=True,
                         step_mode=args.step_mode, compile_options=step_options)
    if args.stream:
        print()
    for i, (reason, n) in enumerate(zip(res.finish_reasons(), res.new_tokens.tolist())):
        why = "the end token" if reason == "stop" else f"--max-new-tokens {args.max_new_tokens}"
        print(f"prompt {i + 1}: {n} new token{'' if n == 1 else 's'}, stopped by {why}", file=sys.stderr)
    if args.stream:
        return 0
    for prompt, row in zip(prompts, res.tokens[:, ids.shape[1]:].tolist()):
        row = row[:row.index(eos)] if eos in row else row
        print(f"{prompt} {tok.decode(row, skip_special_tokens=True)}".strip())
    return 0
