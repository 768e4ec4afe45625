#!/usr/bin/env python
"""Uptraining methods for MHE under rotary positions (issue 61), in the protocol of
``results/uptrain-llama-6x512``: the same MHA source (``--preset llama-6x512`` of
``benchmarks/uptrain.py study``: 6 x 512, 1200 steps on ``offline-english``), converted by each
method, uptrained for 5% and 10% of N with 3 seeds, scored on WikiText-2's test split.

    python benchmarks/uptrain.py methods --data-dir "$MHE_DATA" --out results/uptrain-llama-6x512/methods
    python benchmarks/uptrain.py methods --data-dir "$MHE_DATA" --out OUT --methods mqa,mhe-mul-outputs-kd \\
        --fractions 0.1                                          # the reduced call (RUN.md of the output)
    python benchmarks/uptrain.py methods --cpu-smoke --data-dir "$MHE_DATA" --out /tmp/methods-smoke

Methods (:data:`METHODS`): a kind converted by ``mhe convert``'s weight fit (``mqa``, ``mhe-mul``,
the baselines, re-run on this source), with ``--fit outputs`` (``-outputs``: each sublayer fitted
to the source's outputs on calibration sequences), under ``rope_order=psi-then-rope``
(``-psi-then-rope``: n K/V heads cached, a reference for the order; its fold to one head is not
exact, docs/recipes.md), and uptrained with the source's logits distilled (``-kd``:
``train.distill_from`` = the source run, weight ``--distill-weight``, temperature
``--distill-temperature``). Steps:

1. pre-train the MHA source (or take ``--source RUN``, a finished run of the same settings);
2. convert it once per distinct conversion, in this process on the first GPU (the fits too, in
   float64; the source's calibration read, recorded and scored once for all), timing each (the
   wall time the method adds; the source's calibration and scoring are timed apart);
3. uptrain every (method, fraction, seed) as ``mhe pretrain --init-from`` processes spread over
   the GPUs (``--per-gpu`` at a time on each), started as soon as their conversion is written.

Everything goes under ``--out``: ``runs/`` (as the study's), ``summary.md`` / ``summary.json``
(per method: KV cache, the converted model's test perplexity, the conversion's seconds, mean ±
std of the uptrained perplexities and the runs' mean seconds) and ``methods.log``. With
``--budget-s`` the runs still going at the budget are stopped and the table says what finished;
the same command into the same folder keeps the finished runs and conversions and resumes the
stopped runs (as the study does).

On a fresh machine, with the folder as a device call returned it (every file but the weights,
which are over its 16 MiB a file), the same command makes again only what the unfinished runs
need: a method whose runs all finished needs nothing; one with runs to do needs its conversion
(made again when its weights did not come back) and, for ``-kd``, the source to distil from; a
source needed without weights is pre-trained again (the folder that came back is kept as
``NAME.no-weights``). Pre-training is seeded (``--seed`` 0: the initial weights, the data order)
and so reproduces the source up to the GPU's nondeterministic kernels (atomic adds in backward
passes: not bit for bit; the log gives both runs' scores).
With every conversion kept and no ``-kd`` run left, no source is loaded at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from uptraining.jobs import JOB_TIMES, InlinePool, Job, Pool, common_sets, fraction_label, sets, train_job


@dataclass(frozen=True)
class Method:
    """A kind, how it is converted (``fit``, ``options``) and whether its uptraining distils."""

    kind: str
    fit: str = "weights"
    options: dict = field(default_factory=dict)
    distill: bool = False

    @property
    def conversion(self) -> str:
        """The name of its converted folder (methods that differ only in distillation share it)."""
        order = "-psi-then-rope" if self.options.get("rope_order") == "psi-then-rope" else ""
        return f"{self.kind}{'-outputs' if self.fit == 'outputs' else ''}{order}"


METHODS = {
    "mqa": Method("mqa"),
    "mhe-mul": Method("mhe-mul"),
    "mhe-mul-outputs": Method("mhe-mul", fit="outputs"),
    "mhe-mul-psi-then-rope": Method("mhe-mul", options={"rope_order": "psi-then-rope"}),
    "mhe-mul-kd": Method("mhe-mul", distill=True),
    "mhe-mul-outputs-kd": Method("mhe-mul", fit="outputs", distill=True),
    "mhe-add-outputs": Method("mhe-add", fit="outputs"),
    "mqa-outputs": Method("mqa", fit="outputs"),
}
DEFAULT_METHODS = ("mqa", "mhe-mul", "mhe-mul-outputs", "mhe-mul-psi-then-rope", "mhe-mul-kd", "mhe-mul-outputs-kd",
                   "mhe-add-outputs")
"""The study's rows (``mqa-outputs``, the output fit of the MQA baseline, on request)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="uptrain.py methods", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-dir", default=os.environ.get("MHE_DATA", ""), help="data folder (default $MHE_DATA)")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, of {', '.join(METHODS)} (default: all but mqa-outputs)")
    p.add_argument("--fractions", default="0.05,0.1", help="uptraining steps as fractions of N (default 0.05,0.1)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per method and fraction (default 3)")
    p.add_argument("--source", default="", help="a finished MHA run of the study's settings (default: pre-train one)")
    p.add_argument("--per-gpu", type=int, default=4, help="uptraining processes at a time on each GPU (default 4)")
    p.add_argument("--calibration", type=int, default=64, help="calibration sequences of every conversion "
                                                               "(default 64: the output fit holds 16 out)")
    p.add_argument("--fit-steps", type=int, default=200, help="Adam steps per sublayer of --fit outputs")
    p.add_argument("--fit-lr", type=float, default=1e-3, help="learning rate of --fit outputs")
    p.add_argument("--distill-weight", type=float, default=0.5, help="train.distill_weight of -kd (default 0.5)")
    p.add_argument("--distill-temperature", type=float, default=1.0,
                   help="train.distill_temperature of -kd (default 1)")
    p.add_argument("--budget-s", type=float, default=0, help="stop every run still going after this many seconds")
    p.add_argument("--cpu-smoke", action="store_true", help="a tiny model on the CPU, every stage, in this process")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the commands, run nothing")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown method {bad[0]!r}; valid: {', '.join(METHODS)}")
    args.fractions = tuple(float(f) for f in args.fractions.split(","))
    return args


def study_args(args):
    """The study's own settings (``uptrain.py study --preset llama-6x512``, or its CPU smoke)."""
    from uptraining import study as uptrain_study

    argv = ["--preset", "llama-6x512", "--data-dir", args.data_dir, "--out", args.out]
    s = uptrain_study.parse_args(argv + (["--cpu-smoke"] if args.cpu_smoke else []))
    if args.cpu_smoke:
        args.seeds, args.fractions, args.calibration, args.fit_steps = 2, (0.25,), 16, 10
    return s


def uptrain(s, args, runs: Path, source: Path, name: str, fraction: float, seed: int) -> Job:
    """``mhe pretrain --init-from`` the method's converted folder, as the study's uptraining runs
    (their ``--set`` items), with the distillation settings for ``-kd`` methods."""
    m = METHODS[name]
    steps = max(1, round(fraction * s.steps))
    extra = [f"train.distill_from={source}", f"train.distill_weight={args.distill_weight}",
             f"train.distill_temperature={args.distill_temperature}"] if m.distill else []
    run = f"uptrain-{name}-{fraction_label(fraction)}-seed{seed}"
    cmd = ["pretrain", "--init-from", str(runs / f"convert-{m.conversion}"), "--data", s.data,
           "--data-dir", s.data_dir, "--out", str(runs / run), "--seed", str(seed),
           *sets([*common_sets(s, model=False), f"train.steps={steps}", *extra])]
    return Job(run, cmd, steps, name, "uptrain", fraction, seed)


class GpuPool(Pool):
    """:class:`Pool` over several GPUs: each job on the GPU running the fewest (CUDA_VISIBLE_DEVICES)."""

    def __init__(self, gpus: list[str], per_gpu: int, runs: Path, log) -> None:
        super().__init__(max(1, len(gpus)) * per_gpu, runs, log)
        self.gpus, self.on = gpus, {}

    def start(self, job: Job) -> None:
        if not self.gpus:
            return super().start(job)
        load = {g: sum(self.on.get(j.name) == g for j in self.running) for g in self.gpus}
        gpu = min(self.gpus, key=lambda g: load[g])
        base, self.env = self.env, dict(self.env, CUDA_VISIBLE_DEVICES=gpu)
        try:
            super().start(job)
        finally:
            self.env = base
        self.on[job.name] = gpu


def visible_gpus() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    given = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [g.strip() for g in given.split(",")] if given else [str(i) for i in range(torch.cuda.device_count())]


ROW = "study-row.json"
"""A conversion's row, written beside it (what a later call keeps)."""

SOURCE_ROW = "methods-source.json"
"""The source's row (its score, KV cache, the seconds of its pre-training and calibration), under
``runs/`` (what a later call keeps while the source is not made again)."""


def has_weights(folder: Path) -> bool:
    """Whether a run or converted folder holds a complete checkpoint: a device call's returned
    archive leaves the weights out (files over 16 MiB), the rest of the folder comes back."""
    from mhe.training.checkpoint import latest_checkpoint

    return latest_checkpoint(folder / "checkpoints", report=lambda _msg: None) is not None


def finished(folder: Path) -> bool:
    """Whether a run finished in an earlier call (as :func:`uptraining.jobs.kept` keeps it)."""
    return (folder / "results.json").is_file() and (folder / JOB_TIMES).is_file()


def set_aside(folder: Path, log, why: str) -> None:
    """Rename ``folder`` to ``NAME.no-weights`` (replacing an earlier one) so it is made again."""
    import shutil

    target = folder.with_name(f"{folder.name}.no-weights")
    if target.exists():
        shutil.rmtree(target)
    folder.rename(target)
    log(f"[redo] {folder.name}: {why}; the folder as it came back is {target.name}")


def convert_one(conv, method: Method, out: Path, args, log) -> dict:
    """One conversion written to ``out``, timed; its row (kept from an earlier call into the same
    folder with its weights: a conversion is written whole or not at all, its row beside it)."""
    from mhe.convert.outputs import OutputFit

    if (out / ROW).is_file() and has_weights(out):
        log(f"[convert] {out.name}: kept from an earlier call")
        return json.loads((out / ROW).read_text())
    if out.exists():
        set_aside(out, log, "no weights (an archive returned without them)")
    t = time.time()
    fit = OutputFit(steps=args.fit_steps, lr=args.fit_lr) if method.fit == "outputs" else None
    model, rep = conv.convert(method.kind, out, options=method.options or None, output_fit=fit)
    from mhe.accounting import kv_cache_bytes_per_token

    row = {"ppl_converted": rep.scores["converted"]["score"], "seconds": time.time() - t,
           "kv_bytes_per_token": kv_cache_bytes_per_token(model), "output_fit": rep.options.get("output_fit")}
    (out / ROW).write_text(json.dumps(row))
    log(f"[convert] {out.name}: test perplexity {row['ppl_converted']:.2f} ({row['seconds']:.0f} s)")
    return row


def plan(args, s, runs: Path, source: Path) -> tuple[dict, list, bool]:
    """Per method its uptraining jobs; the methods with runs still to do; and whether the source
    is needed: to convert (a conversion to do, or whose weights did not come back), to distil from
    (a ``-kd`` run to do), or for its row (not kept). Methods whose runs all finished need neither."""
    jobs = {n: [uptrain(s, args, runs, source, n, f, seed) for seed in range(args.seeds) for f in args.fractions]
            for n in args.methods}
    todo = [n for n in args.methods if not all(finished(runs / j.name) for j in jobs[n])]
    conv = [runs / f"convert-{METHODS[n].conversion}" for n in todo]
    need = (not (runs / SOURCE_ROW).is_file() or any(METHODS[n].distill for n in todo)
            or any(not ((c / ROW).is_file() and has_weights(c)) for c in conv))
    return jobs, todo, need


def make_source(args, s, runs: Path, pool, jobs: list, rows: dict, log) -> Path:
    """The source run with its weights: ``--source``, or pre-trained here (again, when an earlier
    call's came back without weights: seeded, so the same run up to the GPU's nondeterministic
    kernels; both test perplexities are logged)."""
    if args.source:
        return Path(args.source)
    source = runs / "pretrain-mha"
    if source.exists() and not has_weights(source):
        before = json.loads((source / "results.json").read_text())["score"] if finished(source) else None
        set_aside(source, log, "no weights; pre-trained again from the same seed and data order"
                  + (f" (it scored {before:.2f})" if before is not None else ""))
    pre = train_job(s, runs, "mha", s.steps, "pretrain")
    pool.start(pre)
    while pool.running:
        pool.poll()
        time.sleep(1)
    jobs.append(pre)
    rows["_pretrain_seconds"] = pre.end - pre.start
    return source


def run(args, s, out: Path, log) -> dict:
    """Steps 1-3 of the module docstring (what an earlier call into ``out`` finished is kept, and
    only what the rest needs is made again); the conversions' rows and every job."""
    runs = out / "runs"
    gpus = [] if args.cpu_smoke else visible_gpus()
    pool = InlinePool(runs, log) if args.cpu_smoke else GpuPool(gpus, args.per_gpu, runs, log)
    t0, jobs, rows, queue = time.time(), [], {}, []
    source = Path(args.source) if args.source else runs / "pretrain-mha"
    planned, todo, need_source = plan(args, s, runs, source)
    for n in args.methods:  # rows of conversions an earlier call made (those still needed are checked below)
        row = runs / f"convert-{METHODS[n].conversion}" / ROW
        if row.is_file():
            rows[METHODS[n].conversion] = json.loads(row.read_text())
    if not need_source:
        log(f"[source] not needed: {'every run finished' if not todo else 'every conversion kept'}")
        rows.update(json.loads((runs / SOURCE_ROW).read_text()))
        queue = [j for n in todo for j in planned[n]]
    else:
        source = make_source(args, s, runs, pool, jobs, rows, log)
        _convert_all(args, source, runs, todo, planned, rows, pool, queue, jobs, log)
    stopped = _drain(pool, queue, jobs, wait=True, deadline=t0 + args.budget_s if args.budget_s else 0)
    return {"rows": rows, "jobs": jobs, "stopped": stopped, "wall_s": time.time() - t0}


def _convert_all(args, source: Path, runs: Path, todo: list, planned: dict, rows: dict, pool, queue: list,
                 jobs: list, log) -> None:
    """The source read, calibrated and scored once; every method with runs to do converted (each
    conversion once) and its runs queued as soon as it is written."""
    from mhe.accounting import kv_cache_bytes_per_token
    from mhe.convert.runs import Converter

    t = time.time()
    with Converter(source, device="cpu" if args.cpu_smoke else "auto", split="test", calibration=args.calibration,
                   log=log) as conv:
        rows["mha"] = {"ppl_source": conv.source_score()["score"],
                       "kv_bytes_per_token": kv_cache_bytes_per_token(conv.src.model)}
        conv.stats()
        rows["_source_seconds"] = time.time() - t
        (runs / SOURCE_ROW).write_text(json.dumps({k: rows[k] for k in ("mha", "_source_seconds",
                                                                         "_pretrain_seconds") if k in rows}))
        done = set()
        for name in todo:
            m = METHODS[name]
            if m.conversion not in done:
                rows[m.conversion] = convert_one(conv, m, runs / f"convert-{m.conversion}", args, log)
                done.add(m.conversion)
            queue += planned[name]
            _drain(pool, queue, jobs, wait=False)


def _drain(pool, queue: list, jobs: list, *, wait: bool, deadline: float = 0) -> list:
    """Start queued jobs as the pool frees; with ``wait``, until all are done or the deadline."""
    while True:
        pool.poll()
        while queue and pool.free() > 0:
            job = queue.pop(0)
            pool.start(job)
            jobs.append(job)
        if not wait or (not queue and not pool.running):
            return []
        if deadline and time.time() > deadline:
            return pool.stop_all("the budget is spent")
        time.sleep(1)


def summarise(args, out: Path, study: dict) -> dict:
    """Per method: the conversion's row and the uptrained perplexities (mean, std, seeds, seconds)."""
    runs, rows = out / "runs", study["rows"]
    table = []
    for name in args.methods:
        m = METHODS[name]
        conv = rows.get(m.conversion, {})
        row = {"method": name, "kind": m.kind, "fit": m.fit, "rope_order": m.options.get("rope_order", ""),
               "distill": m.distill, "kv_bytes_per_token": conv.get("kv_bytes_per_token"),
               "ppl_converted": conv.get("ppl_converted"), "convert_s": conv.get("seconds")}
        for f in args.fractions:
            vals, secs = [], []
            for seed in range(args.seeds):
                folder = runs / f"uptrain-{name}-{fraction_label(f)}-seed{seed}"
                if (folder / "results.json").is_file():
                    vals.append(json.loads((folder / "results.json").read_text())["score"])
                    if (folder / "study-job.json").is_file():
                        secs.append(json.loads((folder / "study-job.json").read_text())["seconds"])
            key = fraction_label(f)
            row[f"ppl_up_{key}"] = statistics.fmean(vals) if vals else None
            row[f"std_up_{key}"] = statistics.stdev(vals) if len(vals) > 1 else None
            row[f"seeds_{key}"] = len(vals)
            row[f"seconds_{key}"] = statistics.fmean(secs) if secs else None
        table.append(row)
    return {"source": rows.get("mha"), "rows": table, "pretrain_s": rows.get("_pretrain_seconds"),
            "source_s": rows.get("_source_seconds"), "wall_s": study["wall_s"],
            "stopped": [j.name for j in study["stopped"]]}


def markdown(args, summary: dict) -> str:
    fr = [fraction_label(f) for f in args.fractions]
    head = ["method", "KV cache / token (bf16)", "converted (step 0)", "conversion s",
            *[f"uptrained {f}" for f in fr], *[f"uptrain s ({f})" for f in fr]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    src = summary["source"] or {}
    lines.append(f"| mha (source) | {src.get('kv_bytes_per_token', 0):,} B | {src.get('ppl_source', float('nan')):.2f} | — |"
                 + " — |" * (2 * len(fr)))

    def cell(r, f):
        mean, std, n = r[f"ppl_up_{f}"], r[f"std_up_{f}"], r[f"seeds_{f}"]
        if mean is None:
            return "—"
        return f"{mean:.2f}" + (f" ± {std:.2f}" if std is not None else "") + f" ({n} seeds)"

    for r in summary["rows"]:
        kv = f"{r['kv_bytes_per_token']:,} B" if r["kv_bytes_per_token"] else "—"
        conv = f"{r['ppl_converted']:,.2f}" if r["ppl_converted"] is not None else "—"
        secs = f"{r['convert_s']:.0f}" if r["convert_s"] is not None else "—"
        up_s = [f"{r[f'seconds_{f}']:.0f}" if r[f"seconds_{f}"] else "—" for f in fr]
        lines.append(f"| {r['method']} | {kv} | {conv} | {secs} | " + " | ".join(cell(r, f) for f in fr)
                     + " | " + " | ".join(up_s) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    s = study_args(args)
    out = Path(args.out)
    if args.dry_run:
        runs = out / "runs"
        for name in args.methods:
            for f in args.fractions:
                for seed in range(args.seeds):
                    print("mhe " + " ".join(uptrain(s, args, runs, runs / "pretrain-mha", name, f, seed).args))
        return 0
    if not args.data_dir:
        sys.exit("give --data-dir (or set MHE_DATA)")
    out.mkdir(parents=True, exist_ok=True)
    from mhe.runtime import configure_threads
    from uptraining.report import software

    configure_threads()
    with open(out / "methods.log", "a") as logf:
        def log(msg: str) -> None:
            line = f"{time.strftime('%H:%M:%S')} {msg}"
            print(line, flush=True)
            logf.write(line + "\n")
            logf.flush()

        sw = software()
        log(f"uptraining methods on {sw['card']} x {len(visible_gpus()) or 1}, torch {sw['torch']} -> {out}")
        study = run(args, s, out, log)
        summary = {**summarise(args, out, study), "software": sw, "argv": sys.argv[1:] if argv is None else argv}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        table = markdown(args, summary)
        (out / "summary.md").write_text(table + "\n")
        log(f"wrote {out}/summary.md and summary.json ({study['wall_s']:.0f} s)")
        print(table)
    return 0 if all(j.rc == 0 for j in study["jobs"]) else 1

