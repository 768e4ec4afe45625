"""Training speed of this tree beside an older tree's, through `mhe pretrain`, on one card in one run.

    python benchmarks/train_bench.py vs-old OUT --old-src OLD/src [--presets gpt2-base,llama-135m]
        [--kinds mha,mhe-mul] [--repeats 2] [--steps 120] [--deadline SECONDS]
    python benchmarks/train_bench.py vs-old OUT --old-src OLD/src --cpu-smoke   # tiny, on a CPU

The training half of issue 40's "behaviour unchanged" (its decoding half is
``decode.py speed --old-src``). For each preset and kind the runs alternate between the trees,
this one first (new, old, new, old for ``--repeats 2``), each one

    mhe pretrain --preset P --data wikitext-2 --attention K --set train.steps=STEPS
        --set train.keep_checkpoints=false --set train.progress=false

with every other setting at its default, the older tree's package on PYTHONPATH for its runs.
Each tree's later runs of a preset start from its first run's ``tokenizer.json``, as a resumed
run does. Rate: the median logged step time after step 40, as input tokens per second. The
spread of one tree's repeats (slowest over fastest) is the noise the new/old ratio is read
against: "within noise" when the ratio of the medians lies inside the larger spread.

Out: ``OUT/train-vs-old.md`` (card, commands, table), ``OUT/train-vs-old.json`` and
``OUT/logs/STAGE.log``; runs under ``OUT/runs/STAGE``. Data: ``$MHE_DATA`` (default
``data-cache/data``) with ``wikitext-2`` (``ptb`` for ``--cpu-smoke``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import torch

from toolbox import ROOT
from train.runs import Runner, fmt, run_figures, seed_tokenizer


def pretrain_args(a: argparse.Namespace, preset: str, kind: str, out: Path) -> list[str]:
    """The `mhe pretrain` arguments of one run (``--cpu-smoke``: tiny sizes on the CPU)."""
    args = ["pretrain", "--preset", preset, "--data", "ptb" if a.cpu_smoke else "wikitext-2", "--attention", kind,
            "--out", str(out), "--set", f"train.steps={a.steps}", "--set", "train.keep_checkpoints=false",
            "--set", "train.progress=false"]
    if a.cpu_smoke:
        args += ["--set", "train.device=cpu", "--set", "train.log_every=2", "--set", "data.limit_lines=300",
                 "--set", "data.vocab_size=400", "--set", "train.batch_size=8", "--set", "data.seq_len=64"]
    return args


def measure(a: argparse.Namespace, runner: Runner, out: Path) -> list[dict]:
    """Every run, alternating the trees; a row per run with its rate (None: not measured)."""
    rows = []
    for preset in a.presets:
        for kind in a.kinds:
            for rep in range(a.repeats):
                for tree, src in (("new", None), ("old", Path(a.old_src).resolve())):
                    stage = f"{preset}-{kind}-{tree}{rep}"
                    seed_tokenizer(out / "runs" / f"{preset}-{a.kinds[0]}-{tree}0", out / "runs" / stage)
                    runner.run(stage, pretrain_args(a, preset, kind, out / "runs" / stage), src=src)
                    f = run_figures(out / "runs" / stage, a.after, 1)
                    rows.append({"preset": preset, "kind": kind, "tree": tree, "repeat": rep,
                                 "tokens_per_s": f and f["tokens_per_s"], "peak_gib": f and f["peak_gib"]})
                    write_json(out, a, rows)
    return rows


def write_json(out: Path, a: argparse.Namespace, rows: list[dict]) -> None:
    tmp = out / "train-vs-old.json.tmp"
    tmp.write_text(json.dumps({"card": card(), "torch": torch.__version__, "old_src": a.old_src, "rows": rows}, indent=1))
    os.replace(tmp, out / "train-vs-old.json")


def card() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"


def table(rows: list[dict]) -> list[str]:
    """One line per (preset, kind): each tree's rates, their spread, new/old and the verdict."""
    lines = ["| preset | kind | new tokens/s (runs) | old tokens/s (runs) | noise (max spread) | new / old | |",
             "|---|---|---|---|---:|---:|---|"]
    for key in dict.fromkeys((r["preset"], r["kind"]) for r in rows):
        rates = {t: [r["tokens_per_s"] for r in rows if (r["preset"], r["kind"]) == key and r["tree"] == t
                     and r["tokens_per_s"]] for t in ("new", "old")}
        if not rates["new"] or not rates["old"]:
            lines.append(f"| {key[0]} | {key[1]} | {_runs(rates['new'])} | {_runs(rates['old'])} | | | not measured |")
            continue
        spread = max(max(v) / min(v) for v in rates.values())
        ratio = statistics.median(rates["new"]) / statistics.median(rates["old"])
        verdict = "within noise" if 1 / spread <= ratio <= spread else ("faster" if ratio > 1 else "slower")
        if len(rates["new"]) == len(rates["old"]) == 1:
            verdict = "one run each: no noise estimate"
        lines.append(f"| {key[0]} | {key[1]} | {_runs(rates['new'])} | {_runs(rates['old'])} | {spread:.3f} | "
                     f"{ratio:.3f} | {verdict} |")
    return lines


def _runs(values: list[float]) -> str:
    return ", ".join(fmt(v) for v in values) or "-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="train_bench.py vs-old", description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--old-src", required=True, help="the older tree's src folder")
    ap.add_argument("--presets", default="gpt2-base")
    ap.add_argument("--kinds", default="mha,mhe-mul")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny-decoder on PTB, a few steps, on the CPU")
    a = ap.parse_args(argv)
    if not (Path(a.old_src) / "mhe" / "__init__.py").is_file():
        ap.error(f"--old-src {a.old_src!r} holds no mhe package (give the older tree's src folder)")
    if a.repeats < 1 or a.steps < 2:
        ap.error(f"--repeats {a.repeats} and --steps {a.steps}: at least 1 and 2")
    a.presets = ["tiny-decoder"] if a.cpu_smoke else [p for p in a.presets.split(",") if p]
    a.kinds = [k for k in a.kinds.split(",") if k]
    a.steps = min(a.steps, 8) if a.cpu_smoke else a.steps
    a.after = 4 if a.cpu_smoke else 40
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = Path(a.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    data = os.environ.get("MHE_DATA", str(ROOT / "data-cache" / "data"))
    runner = Runner(out, str(Path(data).resolve()), a.deadline)
    print(f"card: {card()}; torch {torch.__version__}", flush=True)
    rows = measure(a, runner, out)
    text = "\n".join([
        "# Training speed: this tree beside an older one", "",
        f"Card: {card()}; torch {torch.__version__}; older tree: `{a.old_src}`; rates: median logged step time "
        f"after step {a.after}, input tokens/s; noise: the larger of the two trees' spreads (slowest over fastest run).",
        "", "Commands:", ""] + [f"* {c}" for c in runner.commands] + [""] +
        ([f"Not measured: {', '.join(runner.skipped)}.", ""] if runner.skipped else []) + table(rows)) + "\n"
    (out / "train-vs-old.md").write_text(text)
    print("\n" + text)
    return 0

