"""The stages of the uptraining study (``benchmarks/uptrain.py study``): the shared tokenizer, the
pre-training and scratch runs, the conversions and the uptraining runs, within the wall-time
budget."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from mhe.training.atomic import write_json_atomic
from uptraining.jobs import InlinePool, Job, Pool, common_sets, train_job, uptrain_job


def prepare_tokenizer(args, runs: Path, names: list[str]) -> float:
    """Train the byte-level BPE once on the corpus and give it to every run started from
    scratch (a run reuses a ``tokenizer.json`` it finds in its folder); returns the seconds."""
    import shutil

    from mhe.tasks.text import corpus_lines, tokenizer_for
    from mhe.tasks import build_run

    t = time.time()
    cfg = build_run("lm", args.preset, attention="mha", data=args.data, data_dir=args.data_dir,
                    overrides=common_sets(args))
    folder = runs / "tokenizer"
    tokenizer_for(cfg, folder, corpus_lines(cfg, "train"), task="lm")
    for name in names:
        (runs / name).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(folder / "tokenizer.json", runs / name / "tokenizer.json")
    return time.time() - t


CONVERSIONS = "conversions.json"
"""The conversion rows, written once every kind is converted (what a later call keeps)."""


def convert_all(args, runs: Path, log) -> dict:
    """Every kind from the pre-trained run, fitted (written for uptraining) and naive (scored
    only), each scored on the test split before training; the source scored beside them."""
    from mhe.accounting import count_attention_params, kv_cache_bytes_per_token
    from mhe.convert.runs import Converter

    t = time.time()
    done = runs / CONVERSIONS
    if done.is_file():  # an earlier call of the study converted (the folders are there)
        log(f"[convert] kept from an earlier call ({done.name})")
        return json.loads(done.read_text())
    device = "cpu" if args.cpu_smoke else "auto"
    rows = {}
    with Converter(runs / "pretrain-mha", device=device, split="test", calibration=32, log=log) as conv:
        src = conv.source_score()
        log(f"[convert] the source read, calibrated and scored ({time.time() - t:.0f} s)")
        rows["mha"] = {"ppl_source": src["score"], "attention_params": count_attention_params(conv.src.model),
                       "kv_bytes_per_token": kv_cache_bytes_per_token(conv.src.model),
                       "word_converted": src.get("word_perplexity")}
        for kind in args.kinds:
            kv = args.n_kv_heads if kind == "gqa" else 0
            shutil.rmtree(runs / f"convert-{kind}", ignore_errors=True)  # a call stopped before all were done
            model, rep = conv.convert(kind, runs / f"convert-{kind}", n_kv_heads=kv, align=args.align)
            _, naive = conv.convert(kind, None, n_kv_heads=kv, naive=True)
            rows[kind] = {"ppl_converted": rep.scores["converted"]["score"],
                          "ppl_naive": naive.scores["converted"]["score"],
                          "word_converted": rep.scores["converted"].get("word_perplexity"),
                          "word_naive": naive.scores["converted"].get("word_perplexity"),
                          "attention_params": count_attention_params(model),
                          "kv_bytes_per_token": kv_cache_bytes_per_token(model),
                          "errors": rep.mean_errors()}
            log(f"[convert] {kind}: test perplexity {rows[kind]['ppl_converted']:.2f} "
                f"(naive {rows[kind]['ppl_naive']:.2f}, source {src['score']:.2f}; {time.time() - t:.0f} s so far)")
    rows["_seconds"] = time.time() - t
    write_json_atomic(done, rows)
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
    pool = InlinePool(runs, log) if args.inline else Pool(args.workers, runs, log)
    jobs, waiting, queue = [pre, *scratch], [pre, *scratch], []
    conversions: dict = {}
    converter = threading.Thread(target=lambda: conversions.update(convert_all(args, runs, log)), daemon=True)
    phase = "training"  # -> converting -> uptraining
    while pool.running or waiting or queue or phase != "uptraining":
        pool.poll()
        if pre.rc not in (None, 0):
            pool.stop_all("the pre-training failed")
            break
        if phase == "training" and pre.rc == 0 and not (args.inline and waiting):
            phase = "converting"
            converter.run() if args.inline else converter.start()  # inline: here and now
        if phase == "converting" and not converter.is_alive():
            if not conversions:
                pool.stop_all("the conversions failed (traceback above)")
                break
            phase = "uptraining"
            queue = [uptrain_job(args, runs, k, f, s) for s in range(args.seeds) for f in args.fractions
                     for k in args.kinds]
            jobs += queue
        waiting, queue = _launch(pool, waiting, queue, pre, args, t0, log)
        if args.budget_s and time.time() - t0 > args.budget_s:
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
        if args.budget_s and job.seed > 0 and estimate_s(job, pre, args) > left:
            log(f"[skip] {job.name}: about {estimate_s(job, pre, args):.0f} s, {left:.0f} s of budget left")
            job.rc = "skipped (budget)"
            queue.pop(0)
            continue
        pool.start(queue.pop(0))
    return waiting, queue
