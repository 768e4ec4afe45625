"""Run every (kind, seed) of a comparison with identical settings, by the rerun rule every
command follows: finished runs are reported, not trained again; a folder holding another
comparison is refused; unfinished runs are continued from their checkpoints only with
``--resume``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mhe.data.benchmarks import BENCH_TASKS as BENCH
from mhe.errors import MheError
from mhe.experiments.entries import Entry, entry_dir, parse_entry
from mhe.experiments.paper import paper_tables
from mhe.experiments.presets import EXPERIMENTS, experiment
from mhe.experiments.run_archive import RunFiles, archive_of
from mhe.experiments.summary import write_summary
from mhe.experiments.sweep_progress import Job, SweepProgress
from mhe.output_paths import default_run_dir, free_name
from mhe.runtime import worker_threads
from mhe.tasks import build_task
from mhe.tasks.finetune_config import finetune_config
from mhe.training.checkpoint import write_json_atomic
from mhe.training.config import MIGRATE, apply_overrides
from mhe.tasks import default_run
from mhe.training.loop import RunInterrupted, Trainer
from mhe.training.run_files import RESULTS, is_run_dir, read_json, read_run_record


@dataclass
class Sweep:
    task: str
    preset: str
    kinds: list
    seeds: int
    data: str = ""
    data_dir: str = ""
    overrides: list | None = None  # --set items for every run (the command line's)
    paper: str = ""
    pretrained: str = ""  # fine-tuning: a comparison folder of pre-training runs, one per kind
    metric: str = ""      # summarise this number of results.json instead of the score ("" = the score)
    experiment: str = ""  # a comparison preset whose settings every run starts from ("" = the task's defaults)
    also: tuple = ()      # further results.json numbers the summary tabulates (e.g. ptb_word_perplexity)
    kv_cache: bool = False  # the summary shows each row's KV cache per token
    paired: bool = False    # the summary tests every two rows across seeds (mhe.experiments.paired)

    def report(self) -> dict:
        """How the summary is written (sweep.json keeps it for ``mhe report``); not run settings."""
        return {"paper_table": self.paper, "metric": self.metric or None, "also": tuple(self.also),
                "kv_cache": self.kv_cache, "paired": self.paired}

    def identity(self) -> dict:
        """What sweep.json records: the request and ``run``, the settings every run shares."""
        d = asdict(self)
        for k in ("data_dir", "paper", "metric", "also", "kv_cache", "paired"):
            d.pop(k)
        d["run"] = self.shared_run()
        return d

    def shared_run(self) -> dict:
        """The identity of the first kind's seed-0 run without what differs between runs
        (the kind, the seed, a fine-tuning run's checkpoint)."""
        return shared_identity(run_config(self, self.kinds[0], 0).identity())

    def comparable(self) -> dict:
        """What may not change between invocations of one comparison: the kinds, the
        pre-training runs and every run setting (the seed count, added kinds and operational
        settings such as the checkpoint cadence may)."""
        return _comparable(self.identity())


def shared_identity(ident: dict) -> dict:
    """A run's identity less what differs between the runs of one comparison: the kind and its
    options, the seed, a fine-tuning run's checkpoint; as sweep.json holds it (tuples become lists)."""
    ident = json.loads(json.dumps(ident))
    for k in ("attention", "attn_options"):
        ident["model"].pop(k)
    ident["train"].pop("seed")
    if isinstance(ident["data"].get("task_options"), dict):
        ident["data"]["task_options"].pop("checkpoint", None)
    return ident


def _comparable(identity: dict, source: Path | str = "sweep.json") -> dict:
    run = identity.get("run")
    if run is None or "arch" not in (run.get("model") or {}):
        raise MheError(f"{source} was written by an earlier version (no 'run', or its model as overrides); convert its folder with: "
                       f"{MIGRATE} {Path(source).parent}")
    return {"kinds": identity["kinds"], "pretrained": identity.get("pretrained", ""), **_flatten(run)}


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_config(sweep: Sweep, entry: str | Entry, seed: int, *, progress: bool = False):
    """The RunConfig of one (entry, seed): the task's defaults (or the experiment's settings)
    for the entry's kind, the entry's variant (:mod:`mhe.experiments.entries`), the sweep's
    --set items, the seed. Its progress bars are off unless ``progress`` (a worker's, drawn in
    its ``stderr.log``), and then only where the --set items leave them on. ``entry``: parsed
    (:class:`~mhe.experiments.entries.Entry`; :func:`run_sweep` parses each once), or its text."""
    parsed = parse_entry(entry)
    if sweep.task in BENCH:
        if not sweep.pretrained:
            raise MheError(f"fine-tuning {sweep.task!r} needs --pretrained DIR, a comparison of pre-training runs")
        ckpt = Path(sweep.pretrained) / "runs" / f"{parsed.dir}-seed0"
        if archive_of(ckpt.parent).is_file() and not ckpt.parent.is_dir():
            raise MheError(f"{sweep.pretrained} is packed ({archive_of(ckpt.parent).name}); fine-tuning needs its "
                           f"run folders: mhe report --unpack {sweep.pretrained}")
        if not (ckpt / "results.json").exists():
            raise MheError(f"no finished pre-training run for {str(parsed)!r} at {ckpt}")
        cfg = finetune_config(sweep.task, str(ckpt), data_dir=sweep.data_dir, overrides=list(sweep.overrides or []),
                              seed=seed)
        cfg.train.progress = progress and cfg.train.progress
        return cfg
    if sweep.experiment:
        cfg = experiment(sweep.experiment).run_config(parsed.base, data=sweep.data)
    else:
        cfg = default_run(sweep.task, sweep.preset, parsed.spec, sweep.data)
    cfg.data.data_dir = sweep.data_dir
    cfg = apply_overrides(parsed.apply(cfg), list(sweep.overrides or []))
    cfg.train.seed = seed
    cfg.train.progress = progress and cfg.train.progress
    return cfg


# the paper's per-task fine-tuning tables by architecture (Appendix A): encoder table1-TASK, decoder table2-TASK
FINETUNE_TABLES = {"encoder": "table1", "decoder": "table2"}


def finetune_paper_table(sweep: Sweep) -> str:
    """The paper table a fine-tuning comparison is set beside: the per-task table of the
    pre-trained runs' architecture (``table1-rte`` for an encoder, ``table2-rte`` for a
    decoder), "" where the paper has none (a decoder on CB) or the runs are not there yet
    (:func:`run_config` then says what is missing)."""
    if not sweep.pretrained or not sweep.kinds:
        return ""
    ckpt = Path(sweep.pretrained) / "runs" / f"{entry_dir(sweep.kinds[0])}-seed0"
    if not (ckpt / "config.json").is_file():
        return ""
    arch = read_run_record(ckpt)["model"].get("arch", "")
    name = f"{FINETUNE_TABLES.get(arch, '')}-{sweep.task}"
    return name if name in paper_tables() else ""


def default_compare_dir(name: str, sweep: Sweep) -> Path:
    """``mhe compare``'s folder without ``--out``: ``runs/compare-NAME``, then the task and the
    data where they differ from the comparison preset's (a model preset: always named), e.g.
    ``runs/compare-cpu-ptb`` or ``runs/compare-tiny-decoder-lm-wikitext-2``."""
    exp = EXPERIMENTS.get(name)
    task = "" if exp is not None and sweep.task == exp.task else sweep.task
    data = "" if exp is not None and sweep.data == exp.data else sweep.data
    return default_run_dir("compare", name, task, data)


def check_sweep_dir(out: Path, sweep: Sweep) -> None:
    """Refuse an output folder that holds a different comparison, naming the difference."""
    f = out / "sweep.json"
    if f.exists():
        old = _comparable(read_json(f, what="comparison record")["sweep"], f)
        new = sweep.comparable()
        if set(old["kinds"]) <= set(new["kinds"]):  # added kinds extend a comparison, as more seeds do
            old["kinds"] = new["kinds"]
        diffs = [f"{k}: {old.get(k)!r} there, {new.get(k)!r} now" for k in sorted(set(old) | set(new))
                 if old.get(k) != new.get(k)]
        if diffs:
            raise MheError(f"{out} holds a different comparison ({'; '.join(diffs)}); "
                           f"choose another --out ({free_name(out)} is free)")


def check_packed_finished(out: Path, names: list[str]) -> None:
    """A packed comparison (``runs.tar.xz``) is reported, never trained into: every run asked
    for must be finished in the archive, else the one-line way to unpack it first."""
    missing = sorted(set(names) - set(RunFiles(out).finished()))
    if missing:
        raise MheError(f"{out} is packed ({archive_of(out / 'runs').name}) and {len(missing)} run(s) asked for are "
                       f"not finished in it ({', '.join(missing)}); unpack it first: mhe report --unpack {out}")


def run_sweep(sweep: Sweep, out: str | Path, *, workers: int = 1, resume: bool = False, log=print,
              progress: bool = False) -> dict:
    """Run what is missing, then write the summary. Returns the summary. ``progress``: draw one
    live line for the whole comparison on standard error (:mod:`mhe.experiments.sweep_progress`;
    ``mhe compare`` asks for it on a terminal, unless ``train.progress=false``), messages above it."""
    out = Path(out)
    check_sweep_dir(out, sweep)
    entries = [parse_entry(kind) for kind in sweep.kinds]  # parsed once; the runs are given the entries
    for entry in entries:  # every run's configuration and data checked before any folder is made
        cfg = run_config(sweep, entry, 0)
        task = build_task(cfg.task)
        task.check_label_smoothing(cfg)
        task.check(cfg)
    runs = [(entry, seed, out / "runs" / f"{entry.dir}-seed{seed}") for seed in range(sweep.seeds)
            for entry in entries]
    if archive_of(out / "runs").is_file():
        check_packed_finished(out, [d.name for _, _, d in runs])
        log(f"already finished: results in {archive_of(out / 'runs')}")
        return write_summary(out, **sweep.report())
    unfinished = [f"{k} seed {s}" for k, s, d in runs if is_run_dir(d) and not (d / RESULTS).is_file()]
    if unfinished and not resume:
        raise MheError(f"{out} holds {len(unfinished)} unfinished run(s) of this comparison ({', '.join(unfinished)}); "
                       f"pass --resume to continue them or choose another --out ({free_name(out)} is free)")
    jobs = [(k, s, d) for k, s, d in runs if not (d / RESULTS).is_file()]
    if not jobs:
        log(f"already finished: results in {out}")
        return write_summary(out, **sweep.report())
    model = f"the models of {sweep.pretrained}" if sweep.pretrained else sweep.preset  # fine-tuning: not the preset
    log(f"comparing {', '.join(sweep.kinds)} on {sweep.task} ({model}"
        f"{', ' + sweep.data if sweep.data else ''}), {sweep.seeds} seed(s)")
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "sweep.json", {"sweep": sweep.identity(), "paper": sweep.paper,
                                           **({"metric": sweep.metric} if sweep.metric else {}),
                                           **({"also": list(sweep.also)} if sweep.also else {}),
                                           **({"kv_cache": True} if sweep.kv_cache else {}),
                                           **({"paired": True} if sweep.paired else {})})
    if len(jobs) < len(runs):
        log(f"{len(runs) - len(jobs)} run(s) already finished: results in {out / 'runs'}")
    log(f"{len(jobs)} run(s) to do, {workers} at a time -> {out}")
    shown = progress and run_config(sweep, jobs[0][0], jobs[0][1], progress=True).train.progress
    line = SweepProgress([Job(f"{k} seed {s}", d, run_config(sweep, k, s).train.steps) for k, s, d in jobs],
                         enabled=shown)
    with line:
        if workers <= 1:
            for job, (kind, seed, run_dir) in zip(line.jobs, jobs):
                line.start(job)
                res = _run_inprocess(sweep, kind, seed, run_dir, line.log if shown else log)
                line.finish(job)
                if res["status"] == "interrupted":
                    raise RunInterrupted(res["signal"])
        else:
            _run_parallel(sweep, jobs, workers, line.log if shown else log, line)
    return write_summary(out, **sweep.report())


def _run_inprocess(sweep, kind, seed, run_dir: Path, log) -> dict:
    """One run in this process, without its own progress bar (the comparison's line is drawn
    instead, where it is drawn)."""
    cfg = run_config(sweep, kind, seed)
    resume = is_run_dir(run_dir)  # unfinished (--resume was given: run_sweep checked)
    t0 = time.perf_counter()
    log(f"[{'resume' if resume else 'start'}] {kind} seed {seed}")
    res = Trainer(cfg, build_task(cfg.task), run_dir, resume=resume, log=log).fit()
    if res["status"] in ("finished", "early_stopped"):
        log(f"[done] {kind} seed {seed}: {res['metric']} = {res['score']:.4g} ({time.perf_counter() - t0:.0f} s)")
    return res


def gpu_for_slot(slot: int, gpus: int, visible: str | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` of worker ``slot``'s runs: GPUs round-robin over the slots.
    When the parent already restricts the GPUs (``visible``, e.g. ``"1,2,3"``), the child gets
    the parent's entry (``"2"`` for slot 1), not an index the child would renumber."""
    entries = [e.strip() for e in (visible or "").split(",") if e.strip()]
    if len(entries) >= gpus > 0:  # the parent's list (ids or UUIDs), as torch counted it
        return entries[slot % gpus]
    return str(slot % gpus)


def _run_parallel(sweep, jobs, workers, log, line: SweepProgress | None = None) -> None:
    """One subprocess per run (its progress bar in its ``stderr.log``); GPUs are handed out one per
    worker, CPU threads are shared; ``line`` is told when each run starts and ends."""
    line = line or SweepProgress([Job(f"{k} seed {s}", d, 0) for k, s, d in jobs], enabled=False)
    gpus = torch.cuda.device_count()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    threads = worker_threads(workers)

    def launch(slot_job):
        slot, (job, (kind, seed, run_dir)) = slot_job
        run_dir.mkdir(parents=True, exist_ok=True)
        cfg = run_config(sweep, kind, seed, progress=True)  # its bar in its stderr.log (outside the run's hash)
        write_json_atomic(run_dir / "run.json", cfg.record())
        cmd = [sys.executable, "-m", "mhe", "run", "--config", str(run_dir / "run.json"), "--out", str(run_dir)]
        if is_run_dir(run_dir):  # unfinished (--resume was given: run_sweep checked)
            cmd.append("--resume")
        env = dict(os.environ, MHE_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
        gpu = gpu_for_slot(slot, gpus, visible) if gpus else ""
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log(f"[start] {kind} seed {seed}" + (f" on GPU {gpu}" if gpu else ""))
        line.start(job)
        with open(run_dir / "stderr.log", "a") as err:
            rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err).returncode
        line.finish(job)
        if rc == 0 and (run_dir / "results.json").exists():
            score = json.loads((run_dir / "results.json").read_text())["score"]
            log(f"[done] {kind} seed {seed}: {score:.4g}")
        else:
            log(f"[failed] {kind} seed {seed} (exit {rc}); see {run_dir / 'stderr.log'}")
        return rc

    slots = [(i % workers, job) for i, job in enumerate(zip(line.jobs, jobs))]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        codes = list(pool.map(launch, slots))
    if any(codes):
        raise MheError(f"{sum(1 for c in codes if c)} run(s) failed; rerun the same command with --resume "
                       "to retry them")
