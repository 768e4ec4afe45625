"""Llama-style training where users train (issue 42): `mhe pretrain` defaults on one card.

    python benchmarks/train_bench.py llama OUT [--stages GROUP|STAGE,...] [--data-dir DIR]
        [--deadline SECONDS] [--set KEY=VALUE ...] [--cpu-smoke]

Every stage is ``mhe pretrain --preset P --data wikitext-2 --attention K`` with every other setting
at its default (batch 32 x 2,048 for the Llama presets, 32 x 512 for gpt2-base; compiled, CUDA
graphs, bf16) plus ``train.steps``, ``train.keep_checkpoints=false`` and ``train.progress=false``:

* group ``llama-135m``: ``l135-mha``, ``l135-gqa`` (the preset's 3 K/V heads), ``l135-mhe-mul``,
  120 steps each, then ``l135-warm``: ``l135-mha`` again (20 steps) on the compile cache the first
  run filled. The first stage runs on empty caches (``MHE_CACHE_DIR=OUT/cache``: the tokenizer and
  inductor's FX graph and AOT autograd caches), so its time to the first step is the cold one and
  ``l135-warm``'s the warm one; the later kinds reuse the tokenizer but compile their own graphs.
  Estimated 7 minutes on one H100 (not yet timed).
* group ``llama-1.1b``: ``l1b-mha``, ``l1b-mhe-mul``, ``l1b-gqa`` (4 K/V heads, the preset's), 30
  steps each with ``train.log_every=5``; on a card under 100 GiB (an H100) with
  ``train.activation_checkpointing=full`` (the weights, gradients and AdamW moments alone are
  17.6 GB; the activations of 32 x 2,048 tokens are not held for 22 layers). Estimated 8 minutes.
* group ``gpt2``: ``gpt2-mha``, ``gpt2-mhe-mul``, 120 steps each. Estimated 4 minutes.
* group ``llama-135m-expand``: ``l135-gqa-expand``, ``l135-mhe-mul-expand``: GQA and MHE-Mul with
  ``model.attn_kernel=sdpa-expand`` (K/V heads repeated to the query heads, then SDPA's own choice,
  cuDNN on an H100 at dropout 0, as MHA gets) instead of FlashAttention-2's native grouped heads,
  rows of the llama-135m table: which of the two trains faster at 2,048 tokens. Estimated 4 minutes.

Default: every group in that order, more than 10 minutes on one H100: run it as separate commands
into the same OUT (the caches carry over), each estimated under 9 minutes::

    python benchmarks/train_bench.py llama OUT --stages llama-135m
    python benchmarks/train_bench.py llama OUT --stages l1b-mha,l1b-mhe-mul
    python benchmarks/train_bench.py llama OUT --stages l1b-gqa,gpt2
    python benchmarks/train_bench.py llama OUT --stages llama-135m-expand

Each command's report covers its own stages. Once
``--deadline`` seconds (default 570) have passed the rest are skipped and a running stage is stopped.

Figures per run: tokens/s = batch x sequence / the median logged step time after the first third
of the steps (the first intervals hold compilation and graph capture); peak GiB as the trainer
logs it (``torch.cuda.max_memory_allocated``); time to the first step and the phases from
``results.json``'s ``wall_clock`` (:mod:`mhe.training.run_report`); MFU = F x tokens/s / the
card's dense bf16 peak (989 TFLOP/s for H100 and H200 SXM), with F = 6N + 12 L T d FLOPs per token
(Chowdhery et al. 2022, Appendix B; causal masking not discounted), L layers, T the sequence
length, d = n_heads x head_dim, and N the parameters that take part in a matrix product for every
token: all of the model's (``results.json``'s ``total_params``, the vocabulary unpadded) less the
input embedding tables, which are read by lookup (a tied embedding counts once, as the output
layer; an untied one's input table is left out). With activation checkpointing the recomputed
forward is not counted (model FLOPs, not hardware FLOPs).

Out: ``OUT/llama-speed.md`` (card, torch, commands, tables), ``OUT/llama-speed.json`` (every
figure), both rewritten after every stage so that a run stopped from outside keeps its finished
rows, ``OUT/logs/STAGE.log``, ``OUT/runs/STAGE/``. ``--cpu-smoke``: the same logic with tiny
presets on PTB, a few steps, on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import NamedTuple

import torch

from mhe.bench.common import device_peak
from mhe.models.config import ModelConfig
from train.runs import Runner, fmt, pct, ratio


class Stage(NamedTuple):
    name: str
    group: str
    preset: str
    kind: str
    steps: int
    sets: tuple[str, ...] = ()
    table: str = ""  # the table it is a row of (default: its group's)

    @property
    def label(self) -> str:
        return self.kind + (", K/V repeated (sdpa-expand)" if EXPAND in self.sets else "")


EXPAND = "model.attn_kernel=sdpa-expand"


def stages(smoke: bool, big_card: bool) -> list[Stage]:
    l135, l1b, gpt2 = ("llama-tiny", "llama-tiny", "tiny-decoder") if smoke else ("llama-135m", "llama-1.1b", "gpt2-base")
    n, n1b, warm = (6, 6, 3) if smoke else (120, 30, 20)
    ac = () if big_card else ("train.activation_checkpointing=full",)
    return ([Stage(f"l135-{k}", "llama-135m", l135, k, n) for k in ("mha", "gqa", "mhe-mul")]
            + [Stage("l135-warm", "llama-135m", l135, "mha", warm)]
            + [Stage(f"l135-{k}-expand", "llama-135m-expand", l135, k, n, (EXPAND,), "llama-135m")
               for k in ("gqa", "mhe-mul")]
            + [Stage(f"l1b-{k}", "llama-1.1b", l1b, k, n1b, ("train.log_every=5", *ac)) for k in ("mha", "mhe-mul", "gqa")]
            + [Stage(f"gpt2-{k}", "gpt2", gpt2, k, n) for k in ("mha", "mhe-mul")])


def command(s: Stage, out: Path, smoke: bool, extra_sets: tuple[str, ...] = ()) -> list[str]:
    extra = ["--set", "train.device=cpu", "--set", "train.log_every=2", "--set", "data.limit_lines=300",
             "--set", "data.vocab_size=400", "--set", "model.max_len=64"] if smoke else []
    return (["pretrain", "--preset", s.preset, "--data", "ptb" if smoke else "wikitext-2", "--attention", s.kind,
             "--out", str(out), "--set", f"train.steps={s.steps}", "--set", "train.keep_checkpoints=false",
             "--set", "train.progress=false"] + extra + [a for v in (*s.sets, *extra_sets) for a in ("--set", v)])


def matmul_params(total: int, model: ModelConfig) -> int:
    """N of the module docstring: ``total`` less the input embedding tables read by lookup."""
    lookups = 0 if model.tie_embeddings else model.vocab_size * model.d_model
    if model.positions == "learned":
        lookups += model.max_len * model.d_model
    return total - lookups


def figures(run: Path, steps: int) -> dict | None:
    """A finished run's rate, memory, MFU and wall clock (module docstring), or None."""
    if not (run / "results.json").is_file():
        return None
    results = json.loads((run / "results.json").read_text())
    config = json.loads((run / "config.json").read_text())
    model, train = ModelConfig(**config["model"]), config["resolved_train"]
    seq = min(config["run"]["data"]["seq_len"] or model.max_len, model.max_len)
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    timed = [r for r in records if "step_s" in r]
    late = [r for r in timed if r["step"] > steps // 3] or timed[-1:]
    tok_s = train["batch_size"] * train["grad_accum"] * seq / statistics.median(r["step_s"] for r in late)
    n = matmul_params(results["total_params"], model)
    per_token = 6 * n + 12 * model.n_layers * seq * model.n_heads * model.resolved_head_dim
    peak = device_peak(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    memory = [r["max_mem_gib"] for r in records if "max_mem_gib" in r]
    return {"tokens_per_s": tok_s, "peak_gib": max(memory) if memory else None, "n_matmul_params": n,
            "flops_per_token": per_token, "mfu": per_token * tok_s / peak if peak else None,
            "batch": train["batch_size"], "seq": seq, "steps": results["steps"],
            "activation_checkpointing": train["activation_checkpointing"], "wall_clock": results.get("wall_clock"),
            "vocabulary": results.get("vocabulary")}


def kind_table(title: str, rows: list[tuple[Stage, dict | None]]) -> list[str]:
    base = next((f["tokens_per_s"] for s, f in rows if s.label == "mha" and f), None)
    mem = next((f["peak_gib"] for s, f in rows if s.label == "mha" and f), None)
    lines = [f"### {title}", "", "| kind | tokens/s | vs MHA | MFU | peak GiB | vs MHA | first step s | compile s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s, f in rows:
        if f is None:
            lines.append(f"| {s.label} | not measured |")
            continue
        w = f["wall_clock"] or {}
        lines.append(f"| {s.label} | {fmt(f['tokens_per_s'])} | {ratio(f['tokens_per_s'], base)} | {pct(f['mfu'])} | "
                     f"{fmt(f['peak_gib'], '.1f')} | {ratio(f['peak_gib'], mem)} | "
                     f"{fmt(w.get('time_to_first_step_s'), '.1f')} | {fmt(w.get('compile_s'), '.1f')} |")
    return lines + [""]


def wall_table(rows: list[tuple[Stage, dict | None]]) -> list[str]:
    keys = ("total", "time_to_first_step", "startup", "tokenizer", "data", "model", "compile", "steps", "evaluations",
            "final_evaluation", "writing", "other")
    lines = ["### Wall clock by phase (s; results.json's wall_clock)", "",
             "| stage | " + " | ".join(k.replace("_", " ") for k in keys) + " |", "|---|" + "---:|" * len(keys)]
    for s, f in rows:
        w = (f or {}).get("wall_clock") or {}
        lines.append(f"| {s.name} | " + " | ".join(fmt(w.get(f"{k}_s"), ".1f") for k in keys) + " |")
    return lines + [""]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train_bench.py llama", description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--stages", default="", help="groups (llama-135m, llama-1.1b, gpt2) or stage names, comma-separated")
    ap.add_argument("--data-dir", default=os.environ.get("MHE_DATA", "data-cache"))
    ap.add_argument("--deadline", type=float, default=570.0, help="seconds (default 570)")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny presets, PTB, a few steps, on the CPU")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="extra",
                    help="one more setting for every stage, after the stage's own (repeatable; e.g. "
                         "train.keep_checkpoints=true to score the runs again with mhe eval)")
    a = ap.parse_args(argv)
    big = torch.cuda.is_available() and torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30
    every = stages(a.cpu_smoke, big)
    names = [x.strip() for x in a.stages.split(",") if x.strip()]
    valid = {s.name for s in every} | {s.group for s in every}
    unknown = [x for x in names if x not in valid]
    if unknown:
        ap.error(f"unknown stage(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}")
    a.selected = [s for s in every if not names or s.name in names or s.group in names]
    return a


def report(a: argparse.Namespace, out: Path, card: str, runner: Runner, results: dict) -> str:
    """Write ``llama-speed.md`` and ``.json`` for the stages measured so far (called after each
    stage, so a run stopped from outside keeps its finished rows); returns the text."""
    by = lambda table: [(s, results[s.name]) for s in a.selected  # noqa: E731
                        if s.name in results and (s.table or s.group) == table and not s.name.endswith("-warm")]
    lines = ["# Llama-style training speed, `mhe pretrain` defaults (one card)", "",
             f"Card: {card}; torch {torch.__version__}; MFU: (6N + 12 L T d) x tokens/s / dense bf16 peak, N = the "
             "parameters in a matrix product per token (all but the input embedding lookups); rates: median logged "
             "step time after the first third of the steps.", "", "Commands:", ""]
    lines += [f"* {c}" for c in runner.commands] + [""]
    left = [s.name for s in a.selected if s.name not in results]
    if runner.skipped or left:
        lines += [f"Not measured: {', '.join(runner.skipped + left)}.", ""]
    for group in ("llama-135m", "llama-1.1b", "gpt2"):
        rows = by(group)
        f = next((f for _, f in rows if f), None)
        if rows:
            shape = f"batch {f['batch']} x {f['seq']:,}, {f['steps']} steps" + (
                ", activation checkpointing" if f["activation_checkpointing"] != "none" else "") if f else "not measured"
            lines += kind_table(f"{rows[0][0].preset}, {shape}", rows)
    cold, warm = results.get("l135-mha"), results.get("l135-warm")
    if cold or warm:
        first = lambda f: fmt(((f or {}).get("wall_clock") or {}).get("time_to_first_step_s"), ".1f")  # noqa: E731
        lines += [f"Time to the first step, llama-135m MHA: cold caches {first(cold)} s, warm compile and tokenizer "
                  f"caches {first(warm)} s (from the process's start).", ""]
    lines += wall_table([(s, results[s.name]) for s in a.selected if s.name in results])
    notes = sorted({f["vocabulary"] for f in results.values() if f and f.get("vocabulary")})
    text = "\n".join(lines + [f"* {n}" for n in notes]) + "\n"
    for name, body in (("llama-speed.md", text), ("llama-speed.json", json.dumps(
            {"card": card, "torch": torch.__version__, "commands": runner.commands, "skipped": runner.skipped,
             "stages": dict(results)}, indent=1))):
        (out / f"{name}.tmp").write_text(body)
        os.replace(out / f"{name}.tmp", out / name)
    return text


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runner = Runner(out, str(Path(a.data_dir).resolve()), a.deadline)
    runner.env["MHE_CACHE_DIR"] = str(out / "cache")  # tokenizer and compile caches: empty at the first stage
    runner.env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(f"card: {card}; torch {torch.__version__}; cache {out / 'cache'}", flush=True)
    results, text = {}, ""
    for s in a.selected:
        runner.run(s.name, command(s, out / "runs" / s.name, a.cpu_smoke, tuple(a.extra)))
        results[s.name] = figures(out / "runs" / s.name, s.steps)
        text = report(a, out, card, runner, results)
    print("\n" + text)
    return 0

