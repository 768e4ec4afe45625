"""``mhe bench``: every attention kind side by side on this device, one table a section.
The measuring lives in :mod:`mhe.bench`; this module reads the options and prints."""

from __future__ import annotations

from pathlib import Path

import torch

from mhe.attention import kernels, parse_kinds
from mhe.bench import BENCH_KINDS, bench_attention, bench_decode, bench_decode_attention, bench_training
from mhe.errors import MheError
from mhe.experiments.tables import print_table
from mhe.output_paths import check_output_file
from mhe.training.checkpoint import write_json_atomic


def bench_args(p):
    p.add_argument("--kinds", default=",".join(BENCH_KINDS),
                   help=f"comma-separated attention kinds (default {','.join(BENCH_KINDS)})")
    p.add_argument("--sections", default="attn,train,decode",
                   help="comma-separated sections: attn, train, decode (default all three)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (automatic on a CPU)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training step")
    p.add_argument("--train-batch", type=int, default=16, help="batch of the training section (default 16)")
    p.add_argument("--presets", default="gpt2-base,bert-base", help="presets of the training section")
    p.add_argument("--reps", type=int, default=None, help="timed repeats (default 50; 3 in smoke sizes)")
    p.add_argument("--json", default="", help="also write every figure to this JSON file")
    p.add_argument("--no-graphs", action="store_true", help="time decode eagerly, not as CUDA graph replays")
    p.add_argument("--decode-kernel", default="sdpa", help="sdpa or matmul for one-token grouped attention")
    p.add_argument("--no-pad-vocab", action="store_true", help="keep the preset's vocabulary size in training")


def cmd_bench(args) -> int:
    kinds = list(parse_kinds(args.kinds))
    for k in kinds:
        if k in ("fnet", "linear"):
            raise MheError(f"unknown bench kind {k!r}; valid: {', '.join(BENCH_KINDS)}")
    sections = set(args.sections.split(","))
    bad = sections - {"attn", "train", "decode"}
    if bad:
        raise MheError(f"unknown bench section {sorted(bad)[0]!r}; valid: attn, train, decode")
    for option, value in (("--reps", args.reps), ("--train-batch", args.train_batch)):
        if value is not None and value <= 0:
            raise MheError(f"{option} must be a positive integer, got {value}")
    if args.json:
        check_output_file(args.json, "--json")
    kernels.set_decode_kernel(args.decode_kernel)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    small = args.smoke or not cuda
    card = torch.cuda.get_device_name(dev) if cuda else "CPU"
    print(f"device: {card}; torch {torch.__version__}; {'smoke sizes' if small else 'full sizes'}; "
          f"decode kernel {args.decode_kernel}")
    reps = args.reps or (3 if small else 50)
    warm = 1 if small else 10
    dtype = torch.bfloat16 if cuda else torch.float32
    result = {"device": card, "torch": torch.__version__, "smoke": small}
    if "attn" in sections:
        B, T, m, n = (2, 64, 64, 4) if small else (16, 1024, 768, 12)
        rows = bench_attention(kinds, dev=dev, dtype=dtype, B=B, T=T, m=m, n=n, warmup=warm, reps=reps,
                               compile_model=args.compile)
        result["attention"] = rows
        ref = {r["kind"]: r for r in rows}
        print(f"\nattention sublayer, B={B} T={T} m={m} n={n}, causal, {str(dtype).split('.')[-1]}"
              f"{', torch.compile' if args.compile else ''}")
        print_table(["kind", "fwd ms", "fwd+bwd ms", "vs MQA", "vs MHA"],
                    [[r["kind"], f"{r['fwd_ms']:.3f}", f"{r['fwd_bwd_ms']:.3f}",
                      f"{r['fwd_bwd_ms'] / ref['mqa']['fwd_bwd_ms']:.2f}" if "mqa" in ref else "-",
                      f"{r['fwd_bwd_ms'] / ref['mha']['fwd_bwd_ms']:.2f}" if "mha" in ref else "-"] for r in rows])
    if "train" in sections:
        T = 64 if small else 512
        rows = bench_training(kinds, [p.strip() for p in args.presets.split(",")], dev=dev, B=2 if small else args.train_batch, T=T,
                              steps=reps if small else 20, warmup=warm if small else 5,
                              compile_model=args.compile, small=small, pad_vocab=not args.no_pad_vocab)
        result["training"] = rows
        print(f"\ntraining step, sequence {T}, batch {2 if small else args.train_batch}, "
              f"{'' if args.no_pad_vocab else 'vocabulary padded to a multiple of 128, '}"
              f"{'bf16 autocast' if cuda else 'fp32'}{', torch.compile' if args.compile else ''}")
        print_table(["preset", "kind", "step ms", "tokens/s", "MFU", "peak GiB"],
                    [[r["preset"], r["kind"], f"{r['step_ms']:.1f}", f"{r['tokens_per_s']:,.0f}",
                      "-" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%",
                      "-" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"] for r in rows])
    if "decode" in sections:
        settings = [(2, 32), (1, 16)] if small else [(64, 4096), (1, 1024)]
        m, n = (64, 4) if small else (768, 12)
        graphs = cuda and not args.no_graphs
        rows = bench_decode_attention(kinds, settings, dev=dev, dtype=dtype, m=m, n=n, warmup=warm, reps=reps,
                                      graphs=graphs)
        result["decode_attention"] = rows
        ref = {(r["batch"], r["kind"]): r for r in rows}
        print(f"\ndecode one token, one attention sublayer (m={m}, {n} heads; MHE folded to MQA)"
              f"{'; CUDA graph replays' if graphs else ''}")
        print_table(["batch", "context", "kind", "step ms", "MHA / this", "KV cache MiB"],
                    [[r["batch"], r["context"], r["kind"], f"{r['step_ms']:.4f}",
                      f"{ref[(r['batch'], 'mha')]['step_ms'] / r['step_ms']:.2f}x" if (r["batch"], "mha") in ref else "-",
                      f"{r['kv_cache_mib']:.1f}"] for r in rows])
        settings = [(2, 32), (1, 16)] if small else [(64, 4096), (1, 1024)]
        rows = bench_decode(kinds, settings, dev=dev, dtype=dtype, warmup=warm, reps=reps, small=small, graphs=graphs)
        result["decode"] = rows
        print("\ndecode one token against a filled KV cache (gpt2-base; MHE folded to MQA)"
              f"{'; CUDA graph replays' if graphs else ''}")
        print_table(["batch", "context", "kind", "step ms", "tokens/s", "KV MiB/layer", "KV MiB total"],
                    [[r["batch"], r["context"], r["kind"], f"{r['step_ms']:.3f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['kv_cache_mib_per_layer']:.1f}", f"{r['kv_cache_mib_total']:.1f}"] for r in rows])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.json, result)
    return 0
