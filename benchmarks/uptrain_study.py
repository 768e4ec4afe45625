#!/usr/bin/env python
"""Uptraining study: from a pre-trained MHA decoder to MQA, GQA, MHE-Mul, MHE-Add and SHA.

    python benchmarks/uptrain_study.py --data-dir DATA --out results/uptrain-gpt2-6x384
    python benchmarks/uptrain_study.py --cpu-smoke --data-dir DATA --out /tmp/uptrain-smoke

1. Pre-train an MHA decoder on ``offline-english`` for N steps (``mhe pretrain``).
2. Convert it to every kind (``mhe convert``'s fitted initialisation, through its Python API,
   in this process) and score each converted model on WikiText-2's test split before training
   (and the naive initialisation, mean of the heads and zero head embeddings, beside it).
3. Uptrain each converted model for each fraction of N (default 5% and 10%) and each seed
   (``mhe pretrain --init-from CONVERTED --set train.steps=F*N``), the documented recipe.
4. Beside them, train each kind from scratch for N + the longest uptraining (the same number
   of optimiser steps of the same batch as the uptrained model has seen in all).

Independent trainings run at the same time as processes on the one GPU (as ``mhe compare
--workers`` does): the scratch runs start with the pre-training, the uptraining runs when the
conversions are done, seed 0 of every kind first. A run is only started when its estimated
time fits the wall-time budget (``--budget-s``); at the budget every run still going is stopped
(it saves and exits), so the study ends on time and says what ran. Everything is written under
``--out``: ``RUN.md`` (command, card, software, wall time, what ran), ``summary.md`` /
``summary.csv`` / ``summary.json``, ``uptrain.png`` (perplexity against uptraining steps per
kind) and the run folders under ``runs/``.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

KINDS = ("mqa", "gqa", "mhe-mul", "mhe-add", "sha")
# the default model: GPT-2's layout at 6 layers x 384, 8 heads of 48 (GQA: 2 K/V heads), 256 tokens
GPT2_6x384 = ("model.n_layers=6", "model.d_model=384", "model.n_heads=8", "model.d_ff=1536", "model.max_len=256")
SMOKE_MODEL = ("model.n_layers=2", "model.d_model=32", "model.n_heads=8", "model.d_ff=64", "model.max_len=32")


@dataclass
class Job:
    """One ``mhe pretrain`` process: ``name`` (its folder under runs/), ``args``, ``steps``."""

    name: str
    args: list
    steps: int
    kind: str
    role: str  # pretrain | scratch | uptrain
    fraction: float = 0.0
    seed: int = 0
    start: float = 0.0
    end: float = 0.0
    rc: int | None = None
    proc: subprocess.Popen | None = field(default=None, repr=False)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("MHE_DATA", ""), help="data folder (default $MHE_DATA)")
    p.add_argument("--out", required=True, help="output folder (results/uptrain-...)")
    p.add_argument("--preset", default="gpt2-base", help="model preset of the decoder (default gpt2-base)")
    p.add_argument("--model-set", action="append", default=None, metavar="model.KEY=VALUE",
                   help="model settings (default for gpt2-base: 6 layers x 384, 8 heads, d_ff 1536, 256 tokens)")
    p.add_argument("--steps", type=int, default=2000, help="pre-training steps N (default 2000)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of every run (default 1e-3)")
    p.add_argument("--vocab-size", type=int, default=8192, help="byte-level BPE size (default 8192)")
    p.add_argument("--fractions", default="0.05,0.1", help="uptraining steps as fractions of N (default 0.05,0.1)")
    p.add_argument("--seeds", type=int, default=3, help="uptraining seeds per kind and fraction, as the budget "
                                                        "allows (default 3)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"kinds to convert to (default {','.join(KINDS)})")
    p.add_argument("--n-kv-heads", type=int, default=0, help="GQA's K/V heads (default n/4)")
    p.add_argument("--no-align", dest="align", action="store_false",
                   help="convert without head alignment (default: aligned fit)")
    p.add_argument("--workers", type=int, default=12, help="training processes at a time (default 12)")
    p.add_argument("--budget-s", type=float, default=540, help="wall-time budget in seconds (default 540)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every training run (default: eager; a dozen processes compiling at once "
                        "would spend more time compiling than the short uptraining runs train)")
    p.add_argument("--limit-lines", type=int, default=0, help="data.limit_lines of every run (0: all)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="a tiny model for a few steps on the CPU (checks the whole pipeline in about a minute)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.preset, args.model_set = "tiny-decoder", list(SMOKE_MODEL)
        args.steps, args.batch_size, args.vocab_size, args.seeds = 40, 4, 300, 1
        args.fractions, args.limit_lines, args.workers, args.budget_s = "0.25", 300, 6, 900
    if args.model_set is None:
        args.model_set = list(GPT2_6x384) if args.preset == "gpt2-base" else []
    args.fractions = tuple(float(f) for f in args.fractions.split(","))
    args.kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    return args


# ------------------------------------------------------------------ commands
def common_sets(args, kind: str = "", *, model: bool = True) -> list[str]:
    """``--set`` items every run shares (``model``: also the model and tokenizer settings, which
    an uptraining run takes from the converted folder instead)."""
    items = [f"train.batch_size={args.batch_size}", f"train.lr={args.lr}", "train.schedule=cosine",
             "train.eval_every=0", "train.save_every=0", "train.keep_last=1", "train.progress=false",
             f"train.log_every={5 if args.cpu_smoke else 50}"]
    if model:
        items += [*args.model_set, "data.tokenizer=bpe", f"data.vocab_size={args.vocab_size}"]
        if kind == "gqa" and args.n_kv_heads:
            items.append(f"model.attn_options.n_kv_heads={args.n_kv_heads}")
    if args.limit_lines:
        items.append(f"data.limit_lines={args.limit_lines}")
    items.append(f"train.compile={'true' if args.compile else 'false'}")  # eager unless asked (RUN.md says why)
    if args.cpu_smoke:  # one sliding window at the score's stride (half the window), not a second one at 256
        items += ["train.device=cpu", "data.eval_stride=16"]
    return items


def sets(items: list[str]) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def train_job(args, runs: Path, kind: str, steps: int, role: str) -> Job:
    """Pre-training (MHA, N steps) or a kind from scratch (N + the longest uptraining): the
    same schedule, cosine after a warm-up of 5% of the steps."""
    name = "pretrain-mha" if role == "pretrain" else f"scratch-{kind}"
    cmd = ["pretrain", "--preset", args.preset, "--attention", kind, "--data", "offline-english",
           "--data-dir", args.data_dir, "--out", str(runs / name),
           *sets([*common_sets(args, kind), f"train.steps={steps}", "train.warmup_ratio=0.05"])]
    return Job(name, cmd, steps, kind, role)


def uptrain_job(args, runs: Path, kind: str, fraction: float, seed: int) -> Job:
    """The documented recipe: ``mhe pretrain --init-from CONVERTED --set train.steps=F*N`` (the
    converted run's model and tokenizer, its default warm-up of 5% of the steps)."""
    steps = max(1, round(fraction * args.steps))
    name = f"uptrain-{kind}-{fraction_label(fraction)}-seed{seed}"
    cmd = ["pretrain", "--init-from", str(runs / f"convert-{kind}"), "--data", "offline-english",
           "--data-dir", args.data_dir, "--out", str(runs / name), "--seed", str(seed),
           *sets([*common_sets(args, model=False), f"train.steps={steps}"])]
    return Job(name, cmd, steps, kind, "uptrain", fraction, seed)


def fraction_label(f: float) -> str:
    return f"{100 * f:g}pct"


# ------------------------------------------------------------------ processes on the one GPU
class Pool:
    """At most ``workers`` ``mhe`` processes at a time; each writes its console to its run folder."""

    def __init__(self, workers: int, runs: Path, log) -> None:
        self.workers, self.runs, self.log = workers, runs, log
        self.running: list[Job] = []
        from mhe.runtime import worker_threads

        threads = worker_threads(workers)
        self.env = dict(os.environ, MHE_THREADS=str(threads), OMP_NUM_THREADS=str(threads),
                        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                        TOKENIZERS_PARALLELISM="true")

    def free(self) -> int:
        return self.workers - len(self.running)

    def start(self, job: Job) -> None:
        folder = self.runs / job.name
        folder.mkdir(parents=True, exist_ok=True)
        job.start = time.time()
        with open(folder / "console.log", "ab") as console:
            job.proc = subprocess.Popen([sys.executable, "-m", "mhe", *job.args], env=self.env, cwd=ROOT,
                                        stdout=console, stderr=subprocess.STDOUT)
        self.running.append(job)
        self.log(f"[start] {job.name} ({job.steps} steps)")

    def poll(self) -> list[Job]:
        done = [j for j in self.running if j.proc.poll() is not None]
        for j in done:
            j.rc, j.end = j.proc.returncode, time.time()
            self.running.remove(j)
            self.log(f"[{'done' if j.rc == 0 else f'exit {j.rc}'}] {j.name} ({j.end - j.start:.0f} s)")
        return done

    def stop_all(self, why: str) -> list[Job]:
        """SIGTERM every running job (each saves a checkpoint and exits) and wait for them."""
        for j in self.running:
            self.log(f"[stop] {j.name}: {why}")
            j.proc.terminate()
        stopped = list(self.running)
        for j in stopped:
            try:
                j.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                j.proc.kill()
        self.poll()
        return stopped


# ------------------------------------------------------------------ the study
def prepare_tokenizer(args, runs: Path, names: list[str]) -> float:
    """Train the byte-level BPE once on offline-english and give it to every run started from
    scratch (a run reuses a ``tokenizer.json`` it finds in its folder); returns the seconds."""
    import shutil

    from mhe.tasks.text import corpus_lines, tokenizer_for
    from mhe.training.defaults import build_run

    t = time.time()
    cfg = build_run("lm", args.preset, attention="mha", data="offline-english", data_dir=args.data_dir,
                    overrides=common_sets(args))
    folder = runs / "tokenizer"
    tokenizer_for(cfg, folder, corpus_lines(cfg, "train"), task="lm")
    for name in names:
        (runs / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "tokenizer.json", runs / name / "tokenizer.json")
    return time.time() - t


def convert_all(args, runs: Path, log) -> dict:
    """Every kind from the pre-trained run, fitted (written for uptraining) and naive (scored
    only), each scored on the test split before training; the source scored beside them."""
    from mhe.accounting import count_attention_params, kv_cache_bytes_per_token
    from mhe.convert.runs import Converter

    t = time.time()
    device = "cpu" if args.cpu_smoke else "auto"
    rows = {}
    with Converter(runs / "pretrain-mha", device=device, split="test", calibration=32, log=log) as conv:
        src = conv.source_score()
        rows["mha"] = {"ppl_source": src["score"], "attention_params": count_attention_params(conv.src.model),
                       "kv_bytes_per_token": kv_cache_bytes_per_token(conv.src.model)}
        for kind in args.kinds:
            kv = args.n_kv_heads if kind == "gqa" else 0
            model, rep = conv.convert(kind, runs / f"convert-{kind}", n_kv_heads=kv, align=args.align)
            _, naive = conv.convert(kind, None, n_kv_heads=kv, naive=True)
            rows[kind] = {"ppl_converted": rep.scores["converted"]["score"],
                          "ppl_naive": naive.scores["converted"]["score"],
                          "attention_params": count_attention_params(model),
                          "kv_bytes_per_token": kv_cache_bytes_per_token(model),
                          "errors": rep.mean_errors()}
            log(f"[convert] {kind}: test perplexity {rows[kind]['ppl_converted']:.2f} "
                f"(naive {rows[kind]['ppl_naive']:.2f}, source {src['score']:.2f})")
    rows["_seconds"] = time.time() - t
    return rows


def estimate_s(job: Job, pre: Job, args) -> float:
    """A job's expected wall time: the pre-training's time per step (measured while it shared
    the card with the scratch runs) times its steps, plus a fixed start-up (data, tokenizing)."""
    per_step = (pre.end - pre.start) / max(1, pre.steps)
    return 1.25 * per_step * job.steps + (10 if args.cpu_smoke else 30)


def run_study(args, out: Path, log) -> dict:
    """Every stage; returns what the summary needs (jobs, conversion rows, times). The conversions
    run in a thread of this process, so the scratch runs are watched (and timed) meanwhile."""
    import threading

    runs, t0 = out / "runs", time.time()
    longest = max(round(f * args.steps) for f in args.fractions)
    pre = train_job(args, runs, "mha", args.steps, "pretrain")
    scratch = [train_job(args, runs, k, args.steps + longest, "scratch") for k in args.kinds]
    tok_s = prepare_tokenizer(args, runs, [j.name for j in (pre, *scratch)])
    log(f"[tokenizer] {tok_s:.0f} s")
    pool, jobs, waiting, queue = Pool(args.workers, runs, log), [pre, *scratch], [pre, *scratch], []
    conversions: dict = {}
    converter = threading.Thread(target=lambda: conversions.update(convert_all(args, runs, log)), daemon=True)
    phase = "training"  # -> converting -> uptraining
    while pool.running or waiting or queue or phase != "uptraining":
        pool.poll()
        if pre.rc not in (None, 0):
            pool.stop_all("the pre-training failed")
            break
        if phase == "training" and pre.rc == 0:
            phase = "converting"
            converter.start()
        if phase == "converting" and not converter.is_alive():
            if not conversions:
                pool.stop_all("the conversions failed (traceback above)")
                break
            phase = "uptraining"
            queue = [uptrain_job(args, runs, k, f, s) for s in range(args.seeds) for f in args.fractions
                     for k in args.kinds]
            jobs += queue
        waiting, queue = _launch(pool, waiting, queue, pre, args, t0, log)
        if time.time() - t0 > args.budget_s:
            for j in pool.stop_all(f"the budget of {args.budget_s:.0f} s is spent"):
                j.rc = j.rc if j.rc == 0 else "stopped"
            break
        time.sleep(0.5)
    for j in waiting + queue:
        j.rc = "not started"
    return {"jobs": jobs, "conversions": conversions, "tokenizer_s": tok_s, "wall_s": time.time() - t0}


def _launch(pool: Pool, waiting: list, queue: list, pre: Job, args, t0: float, log):
    """Start what fits: the scratch runs first, then the uptraining runs in priority order (seed 0
    of everything first); a later seed only when its estimate fits the remaining budget."""
    while pool.free() and waiting:
        pool.start(waiting.pop(0))
    while pool.free() and queue:
        job = queue[0]
        left = args.budget_s - (time.time() - t0)
        if job.seed > 0 and estimate_s(job, pre, args) > left:
            log(f"[skip] {job.name}: about {estimate_s(job, pre, args):.0f} s, {left:.0f} s of budget left")
            job.rc = "skipped (budget)"
            queue.pop(0)
            continue
        pool.start(queue.pop(0))
    return waiting, queue


# ------------------------------------------------------------------ summary
def job_score(runs: Path, job: Job) -> float | None:
    """The run's test perplexity (``results.json``), None when it did not finish."""
    import json

    f = runs / job.name / "results.json"
    return json.loads(f.read_text())["score"] if f.is_file() else None


def summarise(args, out: Path, study: dict) -> dict:
    """The summary rows: per kind, its cost (attention parameters, KV cache per token) and its
    test perplexity after conversion, after each uptraining (mean, std and seeds) and from scratch."""
    import statistics

    runs, conv = out / "runs", study["conversions"]
    scores = {j.name: job_score(runs, j) for j in study["jobs"]}
    longest = max(round(f * args.steps) for f in args.fractions)
    rows = []
    for kind in ("mha", *args.kinds):
        c = conv.get(kind, {})
        row = {"kind": kind, "attention_params": c.get("attention_params"),
               "kv_bytes_per_token": c.get("kv_bytes_per_token"),
               "ppl_converted": c.get("ppl_source") if kind == "mha" else c.get("ppl_converted"),
               "ppl_naive": c.get("ppl_naive")}
        for f in args.fractions:
            vals = [scores[j.name] for j in study["jobs"] if j.role == "uptrain" and j.kind == kind
                    and j.fraction == f and scores.get(j.name) is not None]
            row[f"ppl_up_{fraction_label(f)}"] = statistics.fmean(vals) if vals else None
            row[f"std_up_{fraction_label(f)}"] = statistics.stdev(vals) if len(vals) > 1 else None
            row[f"seeds_up_{fraction_label(f)}"] = len(vals)
        row["ppl_scratch"] = scores.get(f"scratch-{kind}") if kind != "mha" else None
        row["scratch_steps"] = args.steps + longest if kind != "mha" else args.steps
        rows.append(row)
    return {"rows": rows, "scores": scores}


def fmt(x, digits: int = 2) -> str:
    return "—" if x is None else f"{x:,.{digits}f}"


def markdown_table(args, rows: list[dict]) -> str:
    n = args.steps
    head = ["kind", "attention params", "KV cache / token (bf16)", "converted (step 0)", "naive init (step 0)"]
    head += [f"uptrained {100 * f:g}% ({round(f * n)} steps)" for f in args.fractions]
    head += [f"from scratch ({n + max(round(f * n) for f in args.fractions)} steps)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["kind"] if r["kind"] != "mha" else f"mha (source, {n} steps)",
                 fmt(r["attention_params"], 0), f"{r['kv_bytes_per_token']:,} B" if r["kv_bytes_per_token"] else "—",
                 fmt(r["ppl_converted"]), fmt(r["ppl_naive"])]
        for f in args.fractions:
            lab = fraction_label(f)
            mean, std, k = r[f"ppl_up_{lab}"], r[f"std_up_{lab}"], r[f"seeds_up_{lab}"]
            cells.append("—" if mean is None else f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else "")
                         + f" ({k} seed{'s' if k != 1 else ''})")
        cells.append(fmt(r["ppl_scratch"]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_tables(args, out: Path, summary: dict) -> None:
    import csv
    import json

    (out / "summary.md").write_text(markdown_table(args, summary["rows"]))
    keys = list(summary["rows"][0])
    with open(out / "summary.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(summary["rows"])
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def plot(args, out: Path, summary: dict) -> None:
    """Test perplexity against uptraining steps per kind (mean and std over seeds; step 0 is the
    converted model), each kind's from-scratch run as a dashed line of its colour, the source
    MHA as a dotted black line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    from mhe.experiments.plots import LABELS, kind_color

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for r in summary["rows"]:
        if r["kind"] == "mha":
            if r["ppl_converted"]:
                ax.axhline(r["ppl_converted"], color="black", ls=":", lw=1, label=f"MHA source ({args.steps} steps)")
            continue
        xs, ys, es = [0], [r["ppl_converted"]], [0.0]
        for f in args.fractions:
            lab = fraction_label(f)
            if r[f"ppl_up_{lab}"] is not None:
                xs.append(round(f * args.steps))
                ys.append(r[f"ppl_up_{lab}"])
                es.append(r[f"std_up_{lab}"] or 0.0)
        color, label = kind_color(r["kind"]), LABELS.get(r["kind"], r["kind"])
        if ys[0] is not None:
            ax.errorbar(xs, ys, yerr=es, marker="o", color=color, capsize=3, label=f"{label} uptrained")
        if r["ppl_scratch"] is not None:
            ax.axhline(r["ppl_scratch"], color=color, ls="--", lw=1, alpha=0.8)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain)
    ax.set_xticks([0, *(round(f * args.steps) for f in args.fractions)])
    ax.set_xlabel("uptraining steps after conversion (0: the converted model)")
    ax.set_ylabel("test perplexity (WikiText-2, per token; log scale)")
    ax.set_title("Conversion from MHA, then uptraining (dashed: the kind from scratch)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "uptrain.png", dpi=120)
    plt.close(fig)


def software() -> dict:
    import platform

    import torch

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else f"CPU ({platform.machine()})"
    return {"card": card, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
            "python": platform.python_version(), "commit": commit, "cpus": os.cpu_count()}


def write_run_md(args, out: Path, study: dict, summary: dict, sw: dict, command: str, started: str) -> None:
    n, longest = args.steps, max(round(f * args.steps) for f in args.fractions)
    tokens = args.batch_size * _max_len(args)
    jobs = study["jobs"]
    lines = [f"# {out.name}", "", "```bash", command, "```", "",
             f"Card: {sw['card']}; torch {sw['torch']} (CUDA {sw['cuda']}), Python {sw['python']}, "
             f"{sw['cpus']} CPU cores, commit {sw['commit']}. Started {started} UTC; wall time "
             f"{study['wall_s'] / 60:.1f} min (tokenizer {study['tokenizer_s']:.0f} s, conversions "
             f"{study['conversions'].get('_seconds', 0):.0f} s; torch.compile {'on' if args.compile else 'off'}). "
             f"Up to {args.workers} training processes shared the machine at once, so times are not comparable "
             "between runs.",
             "", "## What ran", "",
             f"An MHA decoder (preset `{args.preset}` with {', '.join(args.model_set) or 'its own sizes'}) "
             f"pre-trained on `offline-english` for N = {n} steps of {args.batch_size} x {_max_len(args)} tokens "
             f"({n * tokens:,} tokens), lr {args.lr:g}, cosine after a 5% warm-up; converted with "
             f"`mhe convert`'s fitted initialisation ({'aligned heads' if args.align else 'no alignment'}, "
             f"calibration on 32 training sequences) to {', '.join(args.kinds)}; each converted model uptrained with "
             f"`mhe pretrain --init-from` (a fresh AdamW, the same peak lr, cosine after a 5% warm-up) for "
             f"{', '.join(f'{100 * f:g}% ({round(f * n)} steps)' for f in args.fractions)} of N, "
             f"seeds {'0' if args.seeds == 1 else f'0-{args.seeds - 1}'} as the budget allowed (the table says "
             "how many finished).",
             "" if args.compile else "Every run trains eagerly (`train.compile=false`, `--compile` turns it on): with a "
             "dozen processes sharing the card, compiling each would take about as long as an uptraining run trains.",
             "", f"**Same total steps.** Each kind is also trained from scratch for N + {longest} = {n + longest} "
             f"optimiser steps of the same batch and schedule: as many steps and tokens as the model uptrained "
             f"for the longest fraction has seen in all ({n} as MHA, then {longest} as the kind). The compute is "
             "not the same: an MHA step costs more than a step of the cheaper kinds. For the shorter fractions "
             "the same scratch run is shown (it has seen a few more steps than they have).",
             "", "Perplexity: WikiText-2's test split, per BPE token, sliding window (stride: half the window), "
             "as `mhe eval` computes it; step 0 is the converted model before any training, and `naive init` "
             "the mean of the heads with zero head embeddings.", "", markdown_table(args, summary["rows"]),
             "## Runs", "", "| run | steps | status | seconds | test perplexity |", "|---|---:|---|---:|---:|"]
    for j in jobs:
        status = "finished" if j.rc == 0 else (f"exit {j.rc}" if isinstance(j.rc, int) else str(j.rc or "?"))
        secs = f"{j.end - j.start:.0f}" if j.end else "—"
        lines.append(f"| {j.name} | {j.steps} | {status} | {secs} | {fmt(summary['scores'].get(j.name))} |")
    lines += ["", "Files: `summary.md`, `summary.csv`, `summary.json`, `uptrain.png`; `runs/NAME/` holds each "
              "run's `config.json`, `metrics.jsonl`, `results.json` and `console.log`; `runs/convert-KIND/"
              "conversion.json` the per-sublayer reconstruction errors."]
    (out / "RUN.md").write_text("\n".join(lines) + "\n")


def _max_len(args) -> int:
    for item in args.model_set:
        if item.startswith("model.max_len="):
            return int(item.split("=", 1)[1])
    from mhe.models import preset

    return preset(args.preset).max_len


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    if args.dry_run:
        runs = out / "runs"
        for j in [train_job(args, runs, "mha", args.steps, "pretrain"),
                  *(train_job(args, runs, k, args.steps + max(round(f * args.steps) for f in args.fractions),
                              "scratch") for k in args.kinds),
                  *(uptrain_job(args, runs, k, f, s) for s in range(args.seeds) for f in args.fractions
                    for k in args.kinds)]:
            print("mhe " + " ".join(shlex.quote(a) for a in j.args))
        return 0
    if not args.data_dir:
        sys.exit("give --data-dir (or set MHE_DATA): the folder offline-english is read from")
    out.mkdir(parents=True, exist_ok=True)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    with open(out / "study.log", "a") as logf:
        def log(msg: str) -> None:
            line = f"{time.strftime('%H:%M:%S')} {msg}"
            print(line, flush=True)
            logf.write(line + "\n")
            logf.flush()

        from mhe.runtime import configure_threads

        configure_threads()
        sw = software()
        log(f"uptraining study on {sw['card']}, torch {sw['torch']} -> {out}")
        study = run_study(args, out, log)
        summary = summarise(args, out, study)
        write_tables(args, out, summary)
        plot(args, out, summary)
        write_run_md(args, out, study, summary, sw, command, started)
        log(f"wrote {out}/RUN.md, summary.md/.csv/.json, uptrain.png ({study['wall_s']:.0f} s)")
        print(markdown_table(args, summary["rows"]))
    return 0 if all(j.rc == 0 for j in study["jobs"] if j.role != "uptrain" or j.seed == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
