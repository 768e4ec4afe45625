"""Where the time of `mhe pretrain`'s training step goes, kernel by kernel, on one GPU.

    python benchmarks/train_bench.py profile OUT [--presets gpt2-base,bert-base] [--kinds mha,mhe-mul,mqa]
        [--no-dropout-kinds mha,mhe-mul] [--batch 32] [--layers N] [--sdpa-both]
        [--data wikitext-2 --data-dir DIR] [--deadline 215] [--cuda-graphs auto|true|false] [--seq 512] [--cpu-smoke]

For each preset (gpt2-base: causal LM; bert-base: masked LM; a Llama-style one such as
llama-135m: causal LM) and attention kind, the step exactly as ``mhe pretrain`` runs it with its
defaults (batch ``--batch`` x ``--seq`` (512), bf16 autocast, compiled on CUDA, padded vocabulary, chunked
cross-entropy, fused AdamW, clipping, prefetched batches; :mod:`mhe.bench.step_profile`), on
random token blocks (``--data``: a corpus instead). After warm-up (which holds the compilation) it
times 10 steps (wall time per step, as the trainer logs it, and the host's time to queue a step),
then profiles 3 steps with ``torch.profiler``: GPU time per step by category
(:mod:`mhe.bench.profiling`), GPU-busy time, kernels per step, the SDPA backend every attention
call ran on, dynamo's graphs, graph breaks and recompiles, and the top kernels. Variants named in
``--no-dropout-kinds`` run again with ``model.dropout=0 model.attn_dropout=0`` to measure what
dropout costs (presets that train with dropout only). ``--sdpa-both``: every kind with grouped
K/V heads (gqa, mqa, mhe-mul, mhe-add) runs a second time with SDPA's own backend choice
(``mhe.attention.kernels.GROUPED_GRAD_OFF_CUDNN`` off: the step as it ran before grouped training
calls were kept off cuDNN), right after the first. ``--layers N`` trains N of the preset's layers
(the same per-layer work, less to compile; multiply a per-step difference by layers/N).

A first section times the SDPA backends at the first preset's shapes (batch, heads, T=512, d)
with q, k and v as each kind's own projections lay them out (rotary positions and MHE's per-head
factors included; causal for a decoder; the preset's dropout and 0), names the backend SDPA picks
and the one mhe's ``sdpa`` kernel runs on, and (GPT-2/BERT) the dropout rate each backend really
applies at 0.1.

Configurations run in the order of importance (MHA, MQA, MHE-Mul, the other kinds, each followed by
its ``--sdpa-both`` twin, then the dropout-free ones); one that would start past ``--deadline``
seconds (default 215) is skipped and listed as such. Out: ``OUT/profile-train-step.md`` (card,
torch, tables) and ``OUT/profile-train-step.json``. ``--cpu-smoke`` runs it all on a CPU with
tiny presets (``--presets`` if given, shrunk; eager, as ``mhe pretrain`` there; the GPU columns
stay empty).

Under ``torchrun --standalone --nproc_per_node N`` (``mhe pretrain``'s DDP path) every process
runs every configuration with its share of the global batch ``--batch`` (as the trainer splits
``train.batch_size``), each step preceded by the trainer loop's stop-signal agreement; rank 0
writes and prints, with a table of each process's wall, host, agreement, GPU-busy and
collective-kernel (category "communication") ms per step, dynamo's graph count and CPU threads
(``benchmarks/train_bench.py ddp-setups`` runs this script with the other ways of combining DDP and compile). The SDPA section is skipped there (the
single-process run measures it). ``--cpu-smoke`` runs it on gloo processes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from mhe.attention import attention_class
from mhe.bench.common import bench_config
from mhe.bench.profiling import CATEGORIES, dropout_rates, model_attention_inputs, sdpa_backend_rows
from mhe.bench.step_profile import from_main, measure
from mhe.models import preset as model_preset
from mhe.training import distributed

GROUPED = ("gqa", "mqa", "mhe-mul", "mhe-add")  # kinds whose training calls read fewer K/V heads than queries


def plan(presets: list[str], kinds: list[str], no_dropout: list[str], both: bool) -> list[tuple[str, str, bool, bool]]:
    """(preset, kind, dropout on, grouped calls off cuDNN) in the order they are worth running."""
    first = [k for k in ("mha", "mqa", "mhe-mul") if k in kinds]
    order = first + [k for k in kinds if k not in first]
    runs = []
    for p in presets:
        for k in order:
            runs += [(p, k, True, True)] + ([(p, k, True, False)] if both and k in GROUPED else [])
    return runs + [(p, k, False, True) for k in no_dropout for p in presets if model_preset(p).attn_dropout > 0]


def attention_section(a, presets: list[str], kinds: list[str]) -> dict:
    """SDPA's backends at the first preset's shapes and layouts (CUDA only)."""
    dev = torch.device(a.device)
    if dev.type != "cuda":
        return {}
    base = model_preset(presets[0])
    causal = sorted({model_preset(p).arch != "encoder" for p in presets}, reverse=True)
    rates = sorted({model_preset(p).attn_dropout for p in presets} | {0.0}, reverse=True)
    inputs = {k: (lambda k=k: model_attention_inputs(bench_config(presets[0], k, small=False, max_len=a.seq),
                                                     a.batch, a.seq, dev))
              for k in kinds if attention_class(k).supports_cache}  # kinds with queries and keys
    out = {"shape": f"B={a.batch}, {base.n_heads} heads, T={a.seq}, d={base.resolved_head_dim}",
           "backends": sdpa_backend_rows(dev, a.seq, inputs, [(c, p) for c in causal for p in rates])}
    if any(rates):
        out["dropout_rates"] = dropout_rates(dev)
    return out


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _label(r: dict) -> str:
    return (f"{r['preset']} {r['kind']}" + ("" if r["dropout"] else " (no dropout)")
            + ("" if r.get("grouped_off_cudnn", True) else " (SDPA's backend)"))


def attention_lines(att: dict, world: int = 1) -> list[str]:
    if not att:
        return [f"(SDPA backends not measured: {'several processes' if world > 1 else 'no CUDA device'})"]
    rows = [[r["kind"], r["causal"], r["dropout"], r["sdpa_choice"], r["mhe_choice"]]
            + [_f(r[f"{b}_ms"], ".3f") for b in ("mhe", "expand", "flash", "efficient", "cudnn", "math")]
            for r in att["backends"]]
    lines = ["## SDPA backends at the training shapes", "",
             f"{att['shape']}, bf16, forward+backward ms; q, k, v as each kind's attention sublayer lays them out; "
             "`mhe` = mhe's `sdpa` kernel (`mhe.attention.kernels.attend`, under autograd); `expand`: the same on "
             "the K/V heads repeated to every query head (one head: stride 0, no copy); the backends forced "
             "(grouped K/V through `enable_gqa`); - = refused or not applicable.", ""]
    lines += _table(["K/V of", "causal", "dropout", "SDPA picks", "mhe runs on", "mhe ms", "expand ms", "flash ms",
                     "efficient ms", "cudnn ms", "math ms"], rows)
    if "dropout_rates" not in att:
        return lines
    rates = [[b, "refuses" if v is None else _f(v["dropped"], ".4f"), "-" if v is None else _f(v["scale_rate"], ".4f")]
             for b, v in att["dropout_rates"].items()]
    lines += ["", "Dropout each backend applies when asked for 0.1 (fraction of dropped attention weights; the "
              "rate its 1/(1-p) scaling implies):", ""]
    return lines + _table(["backend", "dropped", "rate from scaling"], rates)


def step_lines(rows: list[dict]) -> list[str]:
    main = [[_label(r), r["layers"], _f(r["wall_ms"], ".1f"), _f(r["host_ms"], ".1f"), _f(r["busy_ms"], ".1f"),
             f"{r['kernels']:.0f}", f"{r['tokens_per_s']:,.0f}", _f(r["mfu"] and 100 * r["mfu"], ".1f"),
             _f(r["peak_gib"]), r["sdpa"], r["graphs"], r["graph_breaks"], r["recompiles"], f"{r['compile_s']:.0f}",
             _f(r["comm_ms"])] for r in rows]
    lines = ["## The step", "", "wall: trainer steps in a row, synchronised at the end (as the trainer logs "
             "them); host: median time to queue one step; GPU busy: kernel time per step (collective kernels "
             "included: they run on their own stream and may overlap compute); recompiles: dynamo's guard "
             "failures; collectives: GPU ms per step in NCCL/all-reduce kernels. Several processes: rank 0's "
             "figures, tokens/s over all of them (the per-process table below).", ""]
    lines += _table(["configuration", "layers", "wall ms", "host ms", "GPU busy ms", "kernels/step", "tokens/s",
                     "MFU %", "peak GiB", "SDPA backend per step", "graphs", "graph breaks", "recompiles",
                     "set-up+compile s", "collectives ms"], main)
    cats = [[_label(r)] + [_f(r["categories"][c]) for c in CATEGORIES] for r in rows]
    lines += ["", "## GPU ms per step by category", "", "A fused kernel counts once, in the first category "
              "its name matches (`mhe.bench.profiling`; layernorm includes RMSNorm); dropout's cost is the "
              "dropout-free rows' difference.", ""]
    return lines + _table(["configuration", *CATEGORIES], cats)


def process_lines(rows: list[dict]) -> list[str]:
    """Each process's own figures (several processes only)."""
    per = [[_label(r), p["rank"], _f(p["wall_ms"], ".1f"), _f(p["host_ms"], ".1f"), _f(p["agree_ms"], ".2f"),
            _f(p["busy_ms"], ".1f"), _f(p["comm_ms"]), p["graphs"], p["threads"]]
           for r in rows if r["world"] > 1 for p in r["per_process"]]
    if not per:
        return []
    lines = ["", f"## Per process ({rows[0]['world']} processes)", "", "host: median time to queue one step; "
             "signal agreement: the trainer loop's gloo all-reduce before each step (not in host); GPU busy and "
             "collectives: kernel ms per step on that process's GPU; graphs: dynamo's count of compiled frames "
             "(dynamo's DDP optimiser, off in the trainer, would split a frame per gradient bucket without "
             "changing it); threads: torch's CPU threads.", ""]
    return lines + _table(["configuration", "rank", "wall ms", "host ms", "signal agreement ms", "GPU busy ms",
                           "collectives ms", "graphs", "threads"], per)


def _pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(x, y) to print as x minus y: each kind against MHA, MHE-Mul against MQA, the default against
    SDPA's own backend, with dropout against without."""
    by = {(r["preset"], r["kind"], r["dropout"], r["grouped_off_cudnn"]): r for r in rows}
    out = []
    for r in rows:
        p, k = r["preset"], r["kind"]
        if r["dropout"] and r["grouped_off_cudnn"]:
            others = [by.get((p, "mha", True, True)) if k != "mha" else None,
                      by.get((p, "mqa", True, True)) if k == "mhe-mul" else None,
                      by.get((p, k, True, False)), by.get((p, k, False, True))]
            out += [(r, o) for o in others if o is not None]
    return out


def diff_lines(rows: list[dict]) -> list[str]:
    out = []
    for x, y in _pairs(rows):
        d = [_f(x["categories"][c] - y["categories"][c], "+.2f") for c in CATEGORIES]
        out.append([f"{_label(x)} minus {_label(y)}", _f(x["wall_ms"] - y["wall_ms"], "+.1f"),
                    _f(x["busy_ms"] - y["busy_ms"], "+.1f"), *d])
    if not out:
        return []
    return ["", "## Differences (ms per step)", ""] + _table(["", "wall", "GPU busy", *CATEGORIES], out)


def top_lines(rows: list[dict]) -> list[str]:
    lines = ["", "## Top kernels", ""]
    for r in rows:
        top = [f"    {ms:7.3f} ms  x{n:<4.0f} {name[:110]}" for ms, n, name in r["top"]]
        lines += [f"{_label(r)}:", "", *top, ""]
    return lines


def report(out: Path, a, att: dict, rows: list[dict], skipped: list[str], world: int = 1) -> None:
    card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    launch = ["torchrun", "--standalone", "--nproc_per_node", str(world)] if world > 1 else ["python"]
    split = f"; global batch split over {world} processes, {a.batch // world} rows each" if world > 1 else ""
    head = [f"# Training step profile ({f'{world} processes, DDP' if world > 1 else 'one process'})", "",
            f"Card: {card}; torch {torch.__version__}; cuDNN {cudnn}; `{' '.join(launch + sys.argv)}`; "
            f"world size {world}; batch {a.batch} x {a.seq}{split}{', random tokens' if not a.data else ', ' + a.data}"
            f"{f'; {a.layers} layers of each preset' if a.layers else ''}.", ""]
    lines = head + attention_lines(att, world) + [""] + step_lines(rows) + process_lines(rows) + diff_lines(rows) \
        + top_lines(rows)
    if skipped:
        lines += ["Skipped (past the deadline): " + ", ".join(skipped), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile-train-step.md").write_text("\n".join(lines) + "\n")
    meta = {"card": card, "torch": torch.__version__, "cudnn": cudnn, "argv": sys.argv, "world": world,
            "skipped": skipped}
    (out / "profile-train-step.json").write_text(json.dumps({**meta, "attention": att, "steps": rows}, indent=1))
    print("\n".join(lines))


def _args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="train_bench.py profile", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--presets", default="", help="default gpt2-base,bert-base (tiny-decoder,tiny-encoder in smoke)")
    ap.add_argument("--kinds", default="mha,mhe-mul,mqa")
    ap.add_argument("--no-dropout-kinds", default="mha,mhe-mul")
    ap.add_argument("--batch", type=int, default=0, help="default 32 (4 in smoke)")
    ap.add_argument("--layers", type=int, default=0, help="train this many layers of each preset (default: all)")
    ap.add_argument("--sdpa-both", action="store_true", help="grouped kinds also with SDPA's own backend choice")
    ap.add_argument("--data", default="", help="a corpus (wikitext-2, ...) instead of random tokens")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--deadline", type=float, default=215.0, help="seconds; later configurations are skipped")
    ap.add_argument("--cuda-graphs", default="auto", choices=("auto", "true", "false"),
                    help="train.cuda_graphs (auto: the step replayed as CUDA graphs on CUDA, as mhe pretrain)")
    ap.add_argument("--seq", type=int, default=0, help="tokens per sequence (default 512; 32 in smoke); llama-135m's "
                    "mhe pretrain default is 2048")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args(argv)
    smoke = a.cpu_smoke
    a.device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    seq, a.warmup, a.timed, a.profiled = (32, 1, 3, 2) if smoke else (512, 3, 10, 3)
    a.seq = a.seq or seq
    a.batch = a.batch or (4 if smoke else 32)
    return a


def _shared_dir(d: distributed.Dist) -> Path:
    """One scratch folder for every process (rank 0 builds a corpus's tokenizer there, the others load it)."""
    return Path(from_main(d, tempfile.mkdtemp(prefix="profile-train-step-") if d.main else None))


def main(argv: list[str] | None = None) -> int:
    a = _args(argv)
    presets = a.presets.split(",") if a.presets else ["tiny-decoder", "tiny-encoder"] if a.cpu_smoke \
        else ["gpt2-base", "bert-base"]
    kinds = a.kinds.split(",")
    d = distributed.setup(a.device)  # under torchrun: the process group every configuration's DDP uses
    start = time.perf_counter()
    att = attention_section(a, presets, kinds) if d.world == 1 else {}  # ranks must not diverge in collectives
    rows, skipped, cost, tmp = [], [], {}, _shared_dir(d)
    try:
        for preset, kind, dropout, off_cudnn in plan(presets, kinds, [k for k in a.no_dropout_kinds.split(",") if k],
                                                     a.sdpa_both):
            label = _label(dict(preset=preset, kind=kind, dropout=dropout, grouped_off_cudnn=off_cudnn))
            if from_main(d, time.perf_counter() - start + cost.get(preset, 0.0) > a.deadline):  # all skip alike
                skipped.append(label)
                continue
            t0 = time.perf_counter()
            rows.append(measure(preset, kind, dropout, a, tmp / preset, grouped_off_cudnn=off_cudnn))
            cost[preset] = time.perf_counter() - t0
            if d.main:
                print(f"[{time.perf_counter() - start:.0f} s] {label}: {rows[-1]['wall_ms']:.1f} ms/step", flush=True)
        if d.main:
            report(a.out, a, att, rows, skipped, d.world)
        d.barrier()
    finally:
        if d.main:
            shutil.rmtree(tmp, ignore_errors=True)
        distributed.teardown()
    return 0
