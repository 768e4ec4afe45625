"""Model accounting commands: ``mhe params``, ``mhe memory`` and ``mhe scaling`` (the paper's
parameter counts, Appendix C's memory table and the scaling figures; no training)."""

from __future__ import annotations

import argparse
import json

from mhe.accounting import attention_memory, attention_params, attention_sublayers, gpt3_projection
from mhe.accounting.memory import byte_unit, decoder_memory, memory_table
from mhe.accounting.params import decoder_params
from mhe.accounting.scaling import LABELS, params_vs_heads, params_vs_layers, plot_scaling
from mhe.attention import parse_specs
from mhe.attention.spec import AttentionSpec
from mhe.errors import MheError
from mhe.experiments.tables import print_table
from mhe.models import preset
from mhe.models.config import ARCHS
from mhe.output_paths import check_output_file, image_suffixes


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a preset, or explicit sizes)")
    g.add_argument("--preset", help="a model preset, e.g. bert-base, gpt2-base, transformer-base")
    g.add_argument("--arch", choices=ARCHS, default=None,
                   help="decides the sublayer count: L, L, or 3L (L = --layers per stack)")
    g.add_argument("--layers", type=int, help="layers (per stack for the encoder-decoder)")
    g.add_argument("--heads", type=int, help="attention heads n")
    g.add_argument("--head-dim", type=int, help="head size d")
    g.add_argument("--d-model", type=int, help="model width m (default n*d)")
    g.add_argument("--kinds", default=None,
                   help="comma-separated kinds, 'paper' (the seven of Tables 1-3) or 'all' (default: the paper's "
                        "seven, and the preset's own kind where it is another, e.g. gqa for llama-135m)")
    g.add_argument("--bias", "--with-bias", dest="bias", action="store_true",
                   help="count projection biases too (the paper's counts have none: section 5.3, Table 4)")


def _resolve_geometry(args) -> dict:
    if args.preset:
        cfg = preset(args.preset)
        geo = dict(arch=cfg.arch, n_layers=cfg.n_layers, d_model=cfg.d_model, n_heads=cfg.n_heads,
                   head_dim=cfg.resolved_head_dim, max_len=cfg.max_len,
                   n_kv_heads=getattr(cfg.attn_options, "n_kv_heads", 0))  # the preset's grouping (gqa)
        overrides = {"n_layers": args.layers, "n_heads": args.heads, "head_dim": args.head_dim,
                     "d_model": args.d_model, "arch": args.arch}
        _positive_sizes(args)
        geo.update({k: v for k, v in overrides.items() if v is not None})
        return geo
    missing = [f for f, v in (("--layers", args.layers), ("--heads", args.heads), ("--head-dim", args.head_dim))
               if v is None]
    if missing:
        raise MheError(f"give --preset NAME or all of --layers, --heads, --head-dim (missing {', '.join(missing)})")
    _positive_sizes(args)
    return dict(arch=args.arch or "encoder", n_layers=args.layers, n_heads=args.heads, head_dim=args.head_dim,
                d_model=args.d_model or args.heads * args.head_dim, max_len=512)


def _positive_sizes(args) -> None:
    """Every size given on the command line is a positive integer (named as its option)."""
    for name, option, value in (("layers", "--layers", args.layers), ("n_heads", "--heads", args.heads),
                                ("head_dim", "--head-dim", args.head_dim), ("d_model", "--d-model", args.d_model)):
        if value is not None and value <= 0:
            raise MheError(f"{name} must be a positive integer, got {value} ({option})")


def _kinds(args) -> list[AttentionSpec]:
    """The specs of the kinds ``--kinds`` names (parsed once, here); without it the paper's seven,
    and the preset's own kind after them where it is another (gqa for the Llama presets), so the
    preset's published total appears."""
    if args.kinds is not None:
        return list(parse_specs(args.kinds))
    kinds = list(parse_specs("paper"))
    own = preset(args.preset).spec if args.preset else None
    return kinds + [own] if own and own not in kinds else kinds


def _kind_options(spec: AttentionSpec, geo: dict) -> dict:
    if hasattr(spec.options(), "max_len"):  # linear's sequence matrix
        return {"max_len": geo["max_len"]}
    if spec.grouped and geo.get("n_kv_heads") and geo["n_heads"] % geo["n_kv_heads"] == 0:
        return {"n_kv_heads": geo["n_kv_heads"]}  # the preset's grouping, else the config's default
    return {}


# ---------------------------------------------------------------- mhe params
def params_args(p):
    _model_args(p)
    p.add_argument("--exclude-output", action="store_true",
                   help="leave out the output projection (Table 4, Figures 1/3/4)")
    p.add_argument("--json", action="store_true", help="print {kind: total parameters} as JSON")


def cmd_params(args) -> int:
    geo = _resolve_geometry(args)
    sub = attention_sublayers(geo["arch"], geo["n_layers"])
    totals, rows, kinds = {}, [], _kinds(args)
    for spec in kinds:
        per = attention_params(spec, d_model=geo["d_model"], n_heads=geo["n_heads"], head_dim=geo["head_dim"],
                               include_output=not args.exclude_output, bias=args.bias,
                               **_kind_options(spec, geo))
        totals[spec.name] = per * sub
    if args.json:
        print(json.dumps(totals))
        return 0
    mha = attention_params("mha", d_model=geo["d_model"], n_heads=geo["n_heads"], head_dim=geo["head_dim"],
                           include_output=not args.exclude_output, bias=args.bias) * sub
    for kind, total in totals.items():
        rows.append([kind, f"{total // sub:,}", sub, f"{total:,}", f"{total / 1e6:.2f}M", f"{100 * total / mha:.1f}%"])
    title = args.preset or "custom"
    print(f"{title}: {geo['arch']}, {geo['n_layers']} layers, m={geo['d_model']}, n={geo['n_heads']}, "
          f"d={geo['head_dim']}; {'without' if args.exclude_output else 'with'} output projection"
          f"{', with biases' if args.bias else ''}")
    print_table(["kind", "per sublayer", "sublayers", "total", "total (M)", "of MHA"], rows)
    if args.preset and not args.exclude_output:
        _print_whole_model(args.preset, kinds, geo)
    return 0


def _whole_model_configs(name: str, kinds, geo: dict) -> dict:
    """kind's name -> the preset's decoder configuration with that kind (``kinds``: their specs;
    decoder LM presets only)."""
    cfg = preset(name)
    sizes = {k: geo[k] for k in ("n_layers", "d_model", "n_heads") if geo[k] != getattr(cfg, k)}
    if geo["head_dim"] != cfg.resolved_head_dim:
        sizes["head_dim"] = geo["head_dim"]
    if cfg.arch != "decoder" or geo["arch"] != "decoder" or cfg.adaptive_cutoffs:
        return {}
    out = {}
    for spec in kinds:
        if cfg.rotary and spec.mixes:
            continue  # no rotary positions without queries and keys
        if not spec.causal:
            continue  # mixes whole sequences: no causal decoder
        try:
            out[spec.name] = cfg.replace(attention=spec, **sizes)
        except MheError:
            continue  # e.g. fnet in a causal decoder, el-att where n*d != m
    return out


def _print_whole_model(name: str, kinds, geo: dict) -> None:
    """Every parameter the preset's language model holds, by part (``decoder_params``)."""
    configs = _whole_model_configs(name, kinds, geo)
    if not configs:
        return
    cfg = next(iter(configs.values()))
    print(f"\nwhole model ({name} language model; every parameter, biases and norms included, tied weights "
          f"once; feed-forward: {'SwiGLU, 3 matrices of m x d_ff' if cfg.mlp == 'swiglu' else '2 matrices with biases'}"
          f"; output head {'tied to the embeddings' if cfg.tie_embeddings else 'untied (V x m)'})")
    rows = []
    for kind, c in configs.items():
        p = decoder_params(c)
        rows.append([kind] + [f"{p[k]:,}" for k in ("embeddings", "attention", "feed_forward", "norms", "head",
                                                  "total")] + [f"{p['total'] / 1e6:.2f}M"])
    print_table(["kind", "embeddings", "attention", "feed-forward", "norms", "head", "total", "total (M)"], rows)


# ---------------------------------------------------------------- mhe memory
def memory_args(p):
    _model_args(p)
    p.add_argument("--batch", type=int, default=32, help="batch size B of the activations (default 32)")
    p.add_argument("--seq-len", type=int, default=512, help="sequence length T of the activations (default 512)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON (byte counts) instead of a table")


def cmd_memory(args) -> int:
    if args.preset is None and args.layers is None:
        args.layers = 12  # not used by the per-block table
    for option, value in (("--batch", args.batch), ("--seq-len", args.seq_len)):
        if value <= 0:
            raise MheError(f"{option} must be a positive integer, got {value}")
    geo = _resolve_geometry(args)
    kinds = _kinds(args)
    rows = attention_memory(kinds, d_model=geo["d_model"], n_heads=geo["n_heads"],
                            head_dim=geo["head_dim"], batch=args.batch, seq_len=args.seq_len, bias=args.bias,
                            options={s.name: _kind_options(s, geo) for s in kinds})
    if args.json:
        print(json.dumps([r.as_json() for r in rows]))  # exact byte counts under *_bytes keys
        return 0
    print(f"memory per attention block: m={geo['d_model']}, n={geo['n_heads']}, d={geo['head_dim']}, "
          f"batch {args.batch}, sequence {args.seq_len}, fp16 mixed precision with Adam (exact bytes: --json)")
    print_table(*memory_table(rows))
    configs = _whole_model_configs(args.preset, kinds, geo) if args.preset else {}
    if configs:
        print(f"\nwhole model ({args.preset} language model): every parameter x 20 bytes (Appendix C: fp16 and "
              "fp32 weights and gradients, Adam's two fp32 moments; activations excluded) and the bf16 KV cache "
              "one sequence holds per token (2 x layers x cached K/V heads x d x 2 bytes)")
        rows = [(kind, decoder_memory(c)) for kind, c in configs.items()]
        unit, scale = byte_unit(max(r["training_state_bytes"] for _, r in rows))
        print_table(["kind", "parameters", f"training state ({unit})", "K/V heads cached", "KV cache / token (KiB)"],
                    [[k, f"{r['params']:,}", f"{r['training_state_bytes'] / scale:,.2f}", r["kv_heads"],
                      f"{r['kv_cache_bytes_per_token'] / 1024:,.2f}"] for k, r in rows])
    return 0


# ---------------------------------------------------------------- mhe scaling
def scaling_args(p):
    p.add_argument("--plot", help="write Figures 3 and 4 to this PNG file")
    p.add_argument("--head-dim", type=int, default=64, help="head size d of every curve (default 64)")


def cmd_scaling(args) -> int:
    if args.head_dim <= 0:
        raise MheError(f"--head-dim must be a positive integer, got {args.head_dim}")
    if args.plot:
        check_output_file(args.plot, "--plot", suffixes=image_suffixes(), parent_must_exist=True)
    heads = [1, 2, 4, 8, 16, 32, 64, 128]
    curve = params_vs_heads(heads, args.head_dim)
    print(f"Parameters of one attention sublayer (Q, K, V; d={args.head_dim}) against heads:")
    print_table(["heads"] + [LABELS[k] for k in curve],
                [[n] + [f"{curve[k][i] / 1e6:.2f}M" for k in curve] for i, n in enumerate(heads)])
    print("\nAll attention sublayers (Q, K, V) by layers and heads:")
    bars = params_vs_layers(head_dim=args.head_dim)
    kinds = next(iter(bars.values())).keys()
    print_table(["layers x heads"] + [LABELS[k] for k in kinds],
                [[f"{l} x {n}"] + [f"{v[k] / 1e9:.3f}B" for k in kinds] for (l, n), v in bars.items()])
    print("\nGPT-3 (96 layers, 96 heads of 128; Q, K, V):")
    print_table(["kind", "parameters", "billions"],
                [[k, f"{v:,}", f"{v / 1e9:.2f}B"] for k, v in gpt3_projection().items()])
    if args.plot:
        plot_scaling(args.plot, head_dim=args.head_dim)
        print(f"\nwrote {args.plot}")
    return 0
