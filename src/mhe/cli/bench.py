"""``mhe bench``: every attention kind side by side on this device, one table a section.
The measuring lives in :mod:`mhe.bench`; this module reads the options and prints, one small
function per section."""

from __future__ import annotations

from mhe.accounting.memory import byte_unit
from mhe.attention import parse_specs
from mhe.bench import BENCH_KINDS, SMOKE
from mhe.errors import MheError, one_of
from mhe.experiments.tables import print_table
from mhe.output_paths import check_output_file, make_folder

SECTIONS = ("attn", "train", "decode", "generate")
BASELINE = "mha"  # the row the generate table's "tok/s vs MHA" column divides by


def bench_args(p):
    p.add_argument("--kinds", default=",".join(BENCH_KINDS),
                   help=f"comma-separated attention kinds (default {','.join(BENCH_KINDS)})")
    p.add_argument("--sections", default="attn,train,decode",
                   help="comma-separated sections: attn, train, decode, generate (default attn,train,decode)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (automatic on a CPU)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the attention section and the isolated training step (mhe pretrain's "
                        "step keeps its own default: compiled on a GPU)")
    p.add_argument("--train-batch", type=int, default=16, help="batch of the training section (default 16)")
    p.add_argument("--presets", default="gpt2-base,bert-base", help="presets of the training section")
    p.add_argument("--preset", default=None,
                   help="one decoder preset for the train, decode and generate sections (e.g. llama-135m; "
                        "default: --presets for train, gpt2-base for decode and generate)")
    p.add_argument("--trainer-steps", type=int, default=60,
                   help="steps of mhe pretrain's trainer in the training section (logged every 10; default 60)")
    p.add_argument("--train-data", default="",
                   help="corpus of that trainer (ptb, wikitext-2, ...; default: random token blocks)")
    p.add_argument("--data-dir", default="", help="data folder of --train-data (default: $MHE_DATA or ../shared/data)")
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default 50; 3 in smoke sizes)")
    p.add_argument("--json", default="", help="also write every figure to this JSON file")
    p.add_argument("--no-graphs", action="store_true", help="time the decode and generate sections' steps eagerly (not as CUDA graph replays; "
                        "the generate section otherwise takes model.generate's default step mode)")
    p.add_argument("--kernel", default="auto",
                   help="attention kernel (model.attn_kernel): auto (default: sdpa, and in the decode and generate "
                        "sections split-k-decode for caches with fewer K/V heads than query heads, and for every "
                        "cache at batch 1 in half precision, on a GPU with Triton, else flash-decode for "
                        "one-K/V-head caches), sdpa, sdpa-expand, eager, "
                        "matmul-decode, flash-decode, split-k-decode")
    p.add_argument("--gen-batches", default="1,64", help="generate section: batches at prompt 256 + 256 new tokens")
    p.add_argument("--gen-long", default="64x4096", help="generate section: BATCHxCONTEXT runs (256 new tokens)")
    p.add_argument("--no-peer", action="store_true",
                   help="generate section: skip Hugging Face's generate (GPT-2, or Llama for llama-* presets)")
    p.add_argument("--peer-tokens", type=int, default=64,
                   help="generate section: new tokens of Hugging Face's generate timed (beside a prefill-only call), "
                        "the rest counted at their rate (default 64; 0: time them all)")
    p.add_argument("--gen-deadline", type=float, default=150.0,
                   help="generate section: seconds after which no row starts; the rest are listed as skipped "
                        "(default 150; 0: no limit)")
    p.add_argument("--no-pad-vocab", action="store_true", help="isolated training step: keep the vocabulary unpadded")


def _check(args) -> tuple[list[str], set[str]]:
    from mhe.attention import kernels

    specs = parse_specs(args.kinds)  # the one parse of --kinds
    for spec in specs:
        if spec.mixes:
            raise MheError(f"unknown bench kind {spec.name!r}; valid: {', '.join(BENCH_KINDS)}")
    kinds = [spec.name for spec in specs]  # the rows' names; each bench function looks its kinds up once
    sections = set(args.sections.split(","))
    bad = sections - set(SECTIONS)
    if bad:
        raise MheError(f"unknown bench section {sorted(bad)[0]!r}; valid: {', '.join(SECTIONS)}")
    for option, value in (("--reps", args.reps), ("--train-batch", args.train_batch),
                          ("--trainer-steps", args.trainer_steps)):
        if value is not None and value <= 0:
            raise MheError(f"{option} must be a positive integer, got {value}")
    if args.peer_tokens < 0 or args.peer_tokens == 1:
        raise MheError(f"--peer-tokens must be 0 (every token) or at least 2, got {args.peer_tokens}")
    if args.gen_deadline < 0:
        raise MheError(f"--gen-deadline must be 0 (no limit) or a positive number of seconds, got {args.gen_deadline}")
    if args.json:  # its folder is made now: a path that cannot be written fails before the timings
        make_folder(check_output_file(args.json, "--json").parent, "--json")
    if args.kernel != "auto" and args.kernel not in kernels.KERNELS:
        raise one_of("attention kernel", args.kernel, ("auto", *kernels.KERNELS))
    return kinds, sections


def cmd_bench(args) -> int:
    import torch

    from mhe.training.checkpoint import write_json_atomic

    kinds, sections = _check(args)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    small = args.smoke or not cuda
    card = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"device: {card}; torch {torch.__version__}; {SMOKE if small else 'full sizes'}; "
          f"attention kernel {args.kernel}")
    run = dict(dev=dev, small=small, reps=args.reps or (3 if small else 50), warm=1 if small else 10,
               dtype=torch.bfloat16 if cuda else torch.float32)
    result = {"device": card, "torch": torch.__version__, "smoke": small}
    for name, section in (("attn", attention_section), ("train", training_section), ("decode", decode_section),
                          ("generate", generate_section)):
        if name in sections:
            result.update(section(args, kinds, **run))
    if args.json:
        write_json_atomic(args.json, result)
    return 0


def _dtype_name(dtype) -> str:
    return str(dtype).split(".")[-1]


def attention_section(args, kinds, *, dev, small, reps, warm, dtype) -> dict:
    from mhe.bench import bench_attention
    from mhe.attention.kernels import split_kernel

    B, T, m, n = (2, 64, 64, 4) if small else (16, 1024, 768, 12)
    rows = bench_attention(kinds, dev=dev, dtype=dtype, B=B, T=T, m=m, n=n, warmup=warm, reps=reps,
                           compile_model=args.compile, kernel=split_kernel(args.kernel)[0])
    ref = {r["kind"]: r for r in rows}
    print(f"\nattention sublayer, B={B} T={T} m={m} n={n}, causal, {_dtype_name(dtype)}"
          f"{', torch.compile' if args.compile else ''}")
    print_table(["kind", "fwd ms", "fwd+bwd ms", "vs MQA", "vs MHA", "graphs"],
                [[r["kind"], f"{r['fwd_ms']:.3f}", f"{r['fwd_bwd_ms']:.3f}",
                  f"{r['fwd_bwd_ms'] / ref['mqa']['fwd_bwd_ms']:.2f}" if "mqa" in ref else "-",
                  f"{r['fwd_bwd_ms'] / ref['mha']['fwd_bwd_ms']:.2f}" if "mha" in ref else "-",
                  r.get("graphs", "-")] for r in rows])
    return {"attention": rows}


def training_section(args, kinds, *, dev, small, reps, warm, dtype) -> dict:
    from mhe.bench import bench_training

    T, B = (64, 2) if small else (512, args.train_batch)
    presets = [args.preset] if args.preset else [p.strip() for p in args.presets.split(",")]
    rows = bench_training(kinds, presets, dev=dev, B=B, T=T,
                          steps=reps if small else 20, warmup=warm if small else 5, compile_model=args.compile,
                          small=small, pad_vocab=not args.no_pad_vocab,
                          trainer_steps=min(args.trainer_steps, 6) if small else args.trainer_steps,
                          log_every=2 if small else 10, data=args.train_data, data_dir=args.data_dir)
    pad = "" if args.no_pad_vocab or small else "vocabulary padded to a multiple of 64, "
    print(f"\ntraining step, sequence {T}, batch {B}, {pad}{'bf16 autocast' if dev.type == 'cuda' else 'fp32'}; "
          f"step: the step alone{', torch.compile' if args.compile else ''}; mhe pretrain: its trainer with every "
          f"default, on {args.train_data or 'random tokens'}, median logged rate{' (' + SMOKE + ')' if small else ''}")
    ref = {(r["preset"], r["path"], r["kind"]): r for r in rows}
    print_table(["preset", "shape measured", "kind", "path", "step ms", "tokens/s", "MFU", "vs step", "vs MHA",
                 "peak GiB"],
                [[r["preset"], r["shape"], r["kind"], r["path"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                  "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                  f"{r['tokens_per_s'] / ref[(r['preset'], 'step', r['kind'])]['tokens_per_s']:.2f}",
                  _ratio(r, ref.get((r["preset"], r["path"], "mha"))),
                  "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"] for r in rows])
    return {"training": rows}


def _ratio(row: dict, base: dict | None) -> str:
    return f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"


def decode_section(args, kinds, *, dev, small, reps, warm, dtype) -> dict:
    from mhe.bench import bench_decode, bench_decode_attention

    settings = [(2, 32), (1, 16)] if small else [(64, 4096), (1, 1024)]
    m, n = (64, 4) if small else (768, 12)
    graphs = dev.type == "cuda" and not args.no_graphs
    rows = bench_decode_attention(kinds, settings, dev=dev, dtype=dtype, m=m, n=n, warmup=warm, reps=reps,
                                  graphs=graphs, kernel=args.kernel)
    ref = {(r["batch"], r["kind"]): r for r in rows}
    unit, scale = byte_unit(max(r["kv_cache_bytes"] for r in rows))
    print(f"\ndecode one token, one attention sublayer (m={m}, {n} heads; MHE folded to MQA)"
          f"{'; CUDA graph replays' if graphs else ''}")
    print_table(["batch", "context", "kind", "kernel", "step ms", "MHA / this", f"KV cache {unit}", "cache GB/s"],
                [[r["batch"], r["context"], r["kind"], r["kernel"], f"{r['step_ms']:.4f}",
                  f"{ref[(r['batch'], 'mha')]['step_ms'] / r['step_ms']:.2f}x" if (r["batch"], "mha") in ref else "-",
                  f"{r['kv_cache_bytes'] / scale:.1f}", f"{r['cache_gb_per_s']:,.0f}"] for r in rows])
    model_rows = bench_decode(kinds, settings, dev=dev, dtype=dtype, warmup=warm, reps=reps, small=small,
                              graphs=graphs, kernel=args.kernel, preset=args.preset or "gpt2-base")
    unit, scale = byte_unit(max(r["kv_cache_bytes_total"] for r in model_rows))
    print(f"\ndecode one token against a filled KV cache ({model_rows[0]['shape'] if small else args.preset or 'gpt2-base'}"
          f"; MHE folded to MQA, or one K/V head as it is under RoPE){'; CUDA graph replays' if graphs else ''}")
    print_table(["batch", "context", "kind", "kernel", "step ms", "tokens/s", f"KV {unit}/layer", f"KV {unit} total"],
                [[r["batch"], r["context"], r["kind"], r["kernel"], f"{r['step_ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                  f"{r['kv_cache_bytes_per_layer'] / scale:.1f}", f"{r['kv_cache_bytes_total'] / scale:.1f}"]
                 for r in model_rows])
    return {"decode_attention": rows, "decode": model_rows}


def generate_section(args, kinds, *, dev, small, reps, warm, dtype) -> dict:
    from mhe.bench import generate_settings, run_generate_section

    rows, skipped = run_generate_section(kinds, generate_settings(args.gen_batches, args.gen_long, small), dev=dev,
                                         dtype=dtype, small=small, kernel=args.kernel, graphs=not args.no_graphs,
                                         peer=not args.no_peer, preset=args.preset or "gpt2-base",
                                         peer_tokens=0 if small else args.peer_tokens,
                                         deadline=0.0 if small else args.gen_deadline)
    print_generate_table(rows, dtype, SMOKE if small else args.preset or "gpt2-base")
    partial = sorted({(r["timed_new"], r["new"]) for r in rows if r["timed_new"] < r["new"]})
    for timed_new, new in partial:
        print(f"HF rows of {new} new tokens: a prefill-only call and one of {timed_new} new tokens timed, the other "
              f"{new - timed_new} counted at those tokens' rate (--peer-tokens 0 times every token)")
    if skipped:
        print(f"skipped (past --gen-deadline {args.gen_deadline:g} s): {', '.join(skipped)}")
    return {"generate": rows, "generate_skipped": skipped}


def print_generate_table(rows: list[dict], dtype, shape: str) -> None:
    """The generate section's table: each path beside Hugging Face's and beside MHA."""
    base = {(r["batch"], r["prompt"]): r for r in rows if r["path"].startswith("HF")}
    mha = {(r["batch"], r["prompt"]): r for r in rows if r["kind"] == BASELINE and not r["path"].startswith("HF")}
    print(f"\ngenerate end to end ({shape}, random weights, greedy, {_dtype_name(dtype)}; "
          "prefill included; MHE folded to MQA, or one K/V head as it is under RoPE; model.generate: median of "
          "3 calls after a warm-up (1 in smoke sizes), HF: one call after a short warm-up)")
    unit, scale = byte_unit(max([r["kv_bytes"] for r in rows if r["kv_bytes"] is not None], default=0))
    print_table(["batch", "prompt+new", "path", "kind", "kernel", "ms/token", "tokens/s", "vs HF", "tok/s vs MHA", f"KV {unit}",
                 "prefill ms"],
                [[r["batch"], f"{r['prompt']}+{r['new']}", r["path"], r["kind"], r.get("kernel", "-"),
                  f"{r['ms_per_token']:.3f}",
                  f"{r['tokens_per_s']:,.0f}",
                  f"{base[(r['batch'], r['prompt'])]['seconds'] / r['seconds']:.1f}x"
                  if (r["batch"], r["prompt"]) in base else "-",
                  f"{r['tokens_per_s'] / mha[(r['batch'], r['prompt'])]['tokens_per_s']:.2f}x"
                  if (r["batch"], r["prompt"]) in mha and not r["path"].startswith("HF") else "-",
                  "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / scale:.1f}",
                  "-" if r["prefill_ms"] is None else f"{r['prefill_ms']:.1f}"] for r in rows])
