"""Where the time of `mhe pretrain`'s training step goes, kernel by kernel, on one GPU.

    python benchmarks/profile_train_step.py OUT [--presets gpt2-base,bert-base] [--kinds mha,mhe-mul,mqa]
        [--no-dropout-kinds mha,mhe-mul] [--data wikitext-2 --data-dir DIR] [--deadline 215] [--cpu-smoke]

For each preset (gpt2-base: causal LM; bert-base: masked LM) and attention kind, the step exactly as
``mhe pretrain`` runs it with its defaults (batch 32 x 512, bf16 autocast, compiled on CUDA, padded
vocabulary, chunked cross-entropy, fused AdamW, clipping, prefetched batches): the trainer's own
:class:`~mhe.training.step.StepModule`, :class:`~mhe.training.prefetch.Prefetcher`,
:class:`~mhe.training.step.StepWindow` and :func:`~mhe.training.step.train_step`, set up as
:class:`~mhe.training.loop.Trainer` sets them up, on random token blocks (the task's own collate
and loss; ``--data``: a corpus instead). After warm-up (which holds the compilation) it times 10
steps (wall time per step, as the trainer logs it, and the host's time to queue a step), then
profiles 3 steps with ``torch.profiler``: GPU time per step by category
(:mod:`mhe.bench.profiling`), GPU-busy time, kernels per step, the SDPA backend every attention
call ran on, dynamo's graphs, graph breaks and recompiles, and the top kernels. Variants named in
``--no-dropout-kinds`` run again with ``model.dropout=0 model.attn_dropout=0`` to measure what
dropout costs (a measurement, not a default: the paper trains with 0.1 and 0.1).

A first section times the SDPA backends at the training shapes (MHA, MQA and MHE-Mul's key/value
layouts; causal and not; dropout 0.1 and 0), names the backend SDPA picks and the one mhe's
``sdpa`` kernel runs on, and measures the dropout rate each backend really applies at 0.1.

Configurations run in the order of importance (gpt2 mha, gpt2 mhe-mul, bert mha, bert mhe-mul,
the MQA rows, then the dropout-free ones); one that would start past ``--deadline`` seconds
(default 215: the script stays under 4 minutes on one H100, compilation included) is skipped
and listed as such. Out: ``OUT/profile-train-step.md`` (card, torch, tables) and
``OUT/profile-train-step.json``. ``--cpu-smoke`` runs it all on a CPU with the tiny presets
(eager, as ``mhe pretrain`` there; the GPU categories stay empty).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mhe.bench.common import SMOKE_SIZES, device_peak, flops_per_token  # noqa: E402
from mhe.bench.profiling import (CATEGORIES, by_category, dropout_rates, kernel_times, sdpa_backend_rows,  # noqa: E402
                                 sdpa_calls)
from mhe.bench.training import RandomLM, RandomMLM, real_params  # noqa: E402
from mhe.models import preset as model_preset  # noqa: E402
from mhe.models.vocab_padding import pad_optimizer_state, pad_vocabulary  # noqa: E402
from mhe.tasks import build_task  # noqa: E402
from mhe.training import distributed  # noqa: E402
from mhe.training.batches import BatchOrder  # noqa: E402
from mhe.training.config import compile_wanted  # noqa: E402
from mhe.training.defaults import build_run  # noqa: E402
from mhe.training.optim import build_optimizer  # noqa: E402
from mhe.training.prefetch import Prefetcher  # noqa: E402
from mhe.training.state import TrainerState, seed_all  # noqa: E402
from mhe.training.step import StepModule, StepWindow, train_step  # noqa: E402



def plan(presets: list[str], kinds: list[str], no_dropout: list[str]) -> list[tuple[str, str, bool]]:
    """(preset, kind, dropout on) in the order they are worth running: MHA and MHE-Mul first (the
    issue's comparison), then the other kinds, MQA, and the dropout-free variants."""
    main = [k for k in ("mha", "mhe-mul") if k in kinds] + [k for k in kinds if k not in ("mha", "mhe-mul", "mqa")]
    runs = [(p, k, True) for p in presets for k in main]
    runs += [(p, "mqa", True) for p in presets if "mqa" in kinds]
    return runs + [(p, k, False) for k in no_dropout for p in presets]


def build(preset: str, kind: str, dropout: bool, a, out: Path):
    """The trainer's step objects for one configuration, set up as ``Trainer._build`` does."""
    task_name = "lm" if model_preset(preset).arch == "decoder" else "mlm"  # as mhe pretrain chooses
    items = [f"train.batch_size={a.batch}", f"data.seq_len={a.seq}", "train.progress=false",
             f"model.max_len={max(a.seq, 512) if not a.cpu_smoke else 128}", f"train.device={a.device}"]
    items += [] if dropout else ["model.dropout=0", "model.attn_dropout=0"]
    items += [f"model.{k}={v}" for k, v in SMOKE_SIZES.items()] if a.cpu_smoke else []
    cfg = build_run(task_name, preset, attention=kind, data=a.data, data_dir=a.data_dir, overrides=items)
    task = build_task(task_name) if a.data else (RandomLM() if task_name == "lm" else RandomMLM())
    t, dist = cfg.train, distributed.setup(cfg.train.device)
    seed_all(t.seed)
    model = task.setup(cfg, out, dist).to(dist.device)
    cuda = dist.device.type == "cuda"
    if cuda:
        pad_vocabulary(model)
    opt, sched = build_optimizer(model, t)
    pad_optimizer_state(opt, model)
    order = BatchOrder(task.n_train_items(), t.batch_size, seed=t.seed, rank=dist.rank, world=dist.world)
    state = TrainerState(opt, sched, order)
    step = StepModule(model, dist, compiled=compile_wanted(t, dist.device), note=print)
    data = Prefetcher(order, task.collate, dist.device, ahead=cuda)
    return dict(cfg=cfg, task=task, dist=dist, model=model, state=state, step=step, data=data, window=StepWindow())


def _steps(h, n: int) -> list[float]:
    """Run ``n`` trainer steps; the host's seconds to queue each one."""
    host = []
    for _ in range(n):
        t0 = time.perf_counter()
        train_step(h["step"], h["data"], h["state"], h["task"], h["cfg"].train, h["dist"], h["window"])
        host.append(time.perf_counter() - t0)
    return host


def _sync(h) -> None:
    if h["dist"].device.type == "cuda":
        torch.cuda.synchronize()
    h["window"].read(h["dist"], lambda step, what, v: RuntimeError(f"non-finite {what} {v} at step {step}"))


def measure(preset: str, kind: str, dropout: bool, a, out: Path) -> dict:
    """Compile and warm up, time ``a.timed`` steps, profile ``a.profiled``."""
    torch._dynamo.reset()  # no configuration inherits another's graphs
    torch._dynamo.utils.counters.clear()
    gc.collect()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    h = build(preset, kind, dropout, a, out)
    _steps(h, a.warmup)
    _sync(h)
    compile_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    host = _steps(h, a.timed)
    _sync(h)
    wall = (time.perf_counter() - t1) / a.timed
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        _steps(h, a.profiled)
        _sync(h)
    times = kernel_times(prof, a.profiled)
    c = torch._dynamo.utils.counters
    cfg, model = h["cfg"].model, h["model"]
    tok_s = a.batch * a.seq / wall
    peak = device_peak(torch.cuda.get_device_name()) if cuda else None
    row = {"preset": preset, "kind": kind, "dropout": dropout, "wall_ms": 1000 * wall,
           "host_ms": 1000 * statistics.median(host), "busy_ms": sum(ms for ms, _ in times.values()),
           "kernels": sum(n for _, n in times.values()), "tokens_per_s": tok_s,
           "mfu": flops_per_token(real_params(model), cfg, a.seq) * tok_s / peak if peak else None,
           "peak_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None,
           "sdpa": sdpa_calls(prof, a.profiled), "categories": by_category(times), "compile_s": compile_s,
           "graphs": int(c["stats"]["unique_graphs"]), "graph_breaks": int(sum(c["graph_break"].values())),
           "top": sorted(((ms, n, k) for k, (ms, n) in times.items()), reverse=True)[:10]}
    del h, model, prof
    return row


def attention_section(dev) -> dict:
    if dev.type != "cuda":
        return {}
    return {"backends": sdpa_backend_rows(dev), "dropout_rates": dropout_rates(dev)}


def _table(header: list[str], rows: list[list]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]


def _f(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def _label(r: dict) -> str:
    return f"{r['preset']} {r['kind']}" + ("" if r["dropout"] else " (no dropout)")


def attention_lines(att: dict) -> list[str]:
    if not att:
        return ["(no CUDA device: SDPA backends not measured)"]
    rows = [[r["kind"], r["causal"], r["dropout"], r["sdpa_choice"], r["mhe_choice"]]
            + [_f(r[f"{b}_ms"], ".3f") for b in ("mhe", "expand", "flash", "efficient", "cudnn", "math")]
            for r in att["backends"]]
    lines = ["## SDPA backends at the training shapes", "",
             "B=32, 12 heads, T=512, d=64, bf16, forward+backward ms; K/V laid out as each kind's projections "
             "give them; `mhe` = mhe's `sdpa` kernel (`mhe.attention.kernels.attend`); `expand`: the same on the one "
             "K/V head expanded to 12 (stride 0, no copy); the backends forced; - = refused or not applicable.", ""]
    lines += _table(["K/V of", "causal", "dropout", "SDPA picks", "mhe runs on", "mhe ms", "expand ms", "flash ms",
                     "efficient ms", "cudnn ms", "math ms"], rows)
    rates = [[b, "refuses" if v is None else _f(v["dropped"], ".4f"), "-" if v is None else _f(v["scale_rate"], ".4f")]
             for b, v in att["dropout_rates"].items()]
    lines += ["", "Dropout each backend applies when asked for 0.1 (fraction of dropped attention weights; the "
              "rate its 1/(1-p) scaling implies):", ""]
    return lines + _table(["backend", "dropped", "rate from scaling"], rates)


def step_lines(rows: list[dict]) -> list[str]:
    main = [[_label(r), _f(r["wall_ms"], ".1f"), _f(r["host_ms"], ".1f"), _f(r["busy_ms"], ".1f"),
             f"{r['kernels']:.0f}", f"{r['tokens_per_s']:,.0f}", _f(r["mfu"] and 100 * r["mfu"], ".1f"),
             _f(r["peak_gib"]), r["sdpa"], r["graphs"], r["graph_breaks"], f"{r['compile_s']:.0f}"] for r in rows]
    lines = ["## The step", "", "wall: trainer steps in a row, synchronised at the end (as the trainer logs "
             "them); host: median time to queue one step; GPU busy: kernel time per step.", ""]
    lines += _table(["configuration", "wall ms", "host ms", "GPU busy ms", "kernels/step", "tokens/s", "MFU %",
                     "peak GiB", "SDPA backend per step", "graphs", "graph breaks", "set-up+compile s"], main)
    cats = [[_label(r)] + [_f(r["categories"][c]) for c in CATEGORIES] for r in rows]
    lines += ["", "## GPU ms per step by category", "", "A fused kernel counts once, in the first category "
              "its name matches (`mhe.bench.profiling`); dropout's cost is the dropout-free rows' difference.", ""]
    return lines + _table(["configuration", *CATEGORIES], cats)


def diff_lines(rows: list[dict]) -> list[str]:
    by = {(r["preset"], r["kind"], r["dropout"]): r for r in rows}
    pairs = ((("mhe-mul", True), ("mqa", True)), (("mhe-mul", True), ("mha", True)))
    out = []
    for preset in dict.fromkeys(r["preset"] for r in rows):
        cmp = [(by.get((preset, *a)), by.get((preset, *b))) for a, b in pairs]
        cmp += [(by.get((preset, k, True)), by.get((preset, k, False))) for k in ("mha", "mhe-mul", "mqa")]
        for x, y in cmp:
            if x and y:
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


def report(out: Path, a, att: dict, rows: list[dict], skipped: list[str]) -> None:
    card = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    head = ["# Training step profile (one GPU)", "",
            f"Card: {card}; torch {torch.__version__}; cuDNN {cudnn}; `{' '.join(['python'] + sys.argv)}`; "
            f"batch {a.batch} x {a.seq}{', random tokens' if not a.data else ', ' + a.data}.", ""]
    lines = head + attention_lines(att) + [""] + step_lines(rows) + diff_lines(rows) + top_lines(rows)
    if skipped:
        lines += ["Skipped (past the deadline): " + ", ".join(skipped), ""]
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile-train-step.md").write_text("\n".join(lines) + "\n")
    meta = {"card": card, "torch": torch.__version__, "cudnn": cudnn, "argv": sys.argv, "skipped": skipped}
    (out / "profile-train-step.json").write_text(json.dumps({**meta, "attention": att, "steps": rows}, indent=1))
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--presets", default="gpt2-base,bert-base")
    ap.add_argument("--kinds", default="mha,mhe-mul,mqa")
    ap.add_argument("--no-dropout-kinds", default="mha,mhe-mul")
    ap.add_argument("--data", default="", help="a corpus (wikitext-2, ...) instead of random tokens")
    ap.add_argument("--data-dir", default="")
    ap.add_argument("--deadline", type=float, default=215.0, help="seconds; later configurations are skipped")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    smoke = a.cpu_smoke
    a.device = "cpu" if smoke or not torch.cuda.is_available() else "cuda"
    a.batch, a.seq, a.warmup, a.timed, a.profiled = (4, 32, 1, 3, 2) if smoke else (32, 512, 3, 10, 3)
    presets = ["tiny-decoder", "tiny-encoder"] if smoke else a.presets.split(",")
    start = time.perf_counter()
    att = attention_section(torch.device(a.device))
    rows, skipped, cost = [], [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for preset, kind, dropout in plan(presets, a.kinds.split(","), [k for k in a.no_dropout_kinds.split(",") if k]):
            label = f"{preset} {kind}" + ("" if dropout else " (no dropout)")
            if time.perf_counter() - start + cost.get(preset, 0.0) > a.deadline:
                skipped.append(label)
                continue
            t0 = time.perf_counter()
            rows.append(measure(preset, kind, dropout, a, Path(tmp) / preset))
            cost[preset] = time.perf_counter() - t0
            print(f"[{time.perf_counter() - start:.0f} s] {label}: {rows[-1]['wall_ms']:.1f} ms/step", flush=True)
    report(a.out, a, att, rows, skipped)


if __name__ == "__main__":
    main()
