"""The one training loop every task uses.

AdamW (fused on CUDA) with LambdaLR schedules, gradient accumulation and clipping, bf16
autocast on GPU (fp32 on CPU), ``torch.compile`` (by default on CUDA), evaluation every N
steps with early stopping, atomic checkpoints with exact resume, SIGINT/SIGTERM
handling, and, through :func:`~mhe.training.parallelize.parallelize`, activation checkpointing,
``torch.compile`` and DDP or FSDP under ``torchrun`` with the same global batch as one process.
The run's state lives in one :class:`~mhe.training.state.TrainerState`.

On a GPU a step never waits for the device: the next batch is prepared during the step
(:mod:`mhe.training.prefetch`), and the loss and gradient norm are read, and checked for
finiteness, once per log interval (:class:`~mhe.training.step.StepWindow`). The vocabulary
matrices are padded for the tensor cores (:mod:`mhe.models.vocab_padding`).
"""

from __future__ import annotations

import contextlib
import copy
import math
import shutil
from pathlib import Path

import torch

from mhe.accounting import count_attention_params
from mhe.errors import MheError
from mhe.models.vocab_padding import pad_vocabulary, padding_numel
from mhe.output_paths import free_name, make_folder
from mhe.progress import note
from mhe.runtime import cache_root, configure_compile_cache
from mhe.training import checkpoint as ckpt
from mhe.training import distributed
from mhe.training.atomic import remove_temporaries, write_json_atomic
from mhe.training.batches import BatchOrder
from mhe.training.config import RunConfig, compile_wanted
from mhe.training.optim import param_groups
from mhe.training.parallelize import Parallelized, home, parallelize, resolve_mode
from mhe.training.prefetch import Prefetcher
from mhe.training.run_files import (CONFIG, METRICS, RESULTS, differences, is_run_dir, read_results, read_run_record,
                                    run_config_from_dict, truncate_metrics, write_run_record)
from mhe.training.run_log import RunLog, SignalWatch
from mhe.training.run_report import RunClock, vocabulary_note
from mhe.training.state import TrainerState, deterministic_kernels, seed_all, state_problem
from mhe.training.state_check import saved_shapes
from mhe.training.step import StepWindow, evaluation_precision, train_step
from mhe.training.task import Task
from mhe.training.weights import BEST, has_best, load_best, save_best

DONE = ("finished", "early_stopped")  # statuses after which results.json is written

__all__ = ["DONE", "RunInterrupted", "Trainer", "TrainingStopped", "seed_all"]


class TrainingStopped(MheError):
    """The run stopped itself (non-finite loss); the message says where and what is left."""


class RunInterrupted(KeyboardInterrupt):
    """A signal stopped a run after it saved; raised by callers that run several (sweeps) so
    the command exits with ``exit_code``: 128 + the signal number (130 SIGINT, 143 SIGTERM)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.exit_code = 128 + int(signum)


class Trainer:
    """Trains ``task`` as ``cfg`` says into the run folder ``out`` (``resume``: continue it).
    ``prefetch``: prepare each batch during the step before it (default: on CUDA)."""

    def __init__(self, cfg: RunConfig, task: Task, out: str | Path, *, resume: bool = False,
                 log=print, prefetch: bool | None = None) -> None:
        self.cfg, self.task, self.out, self.resume, self.log = cfg, task, Path(out), resume, log
        self.original = copy.deepcopy(cfg)  # what the user asked for: hashed and saved
        self.cfg_hash = self.original.hash()
        self.last_saved: Path | None = None
        self.prefetch = prefetch
        self.window = StepWindow()
        self.trained = None  # the Dist of a run this trainer trained (not one it found finished)
        self.vocab_note = None
        self.parallel: Parallelized | None = None  # the model made ready for the steps (_build)

    def fit(self) -> dict:
        """Set up (or resume), train until the schedule ends, the run stops early or a signal
        arrives, then evaluate the best weights and write ``results.json`` (with the run's wall
        clock by phase, :mod:`mhe.training.run_report`)."""
        self.clock = RunClock()
        with self.clock.running(), deterministic_kernels(self.cfg.train.deterministic):
            result = self._fit()
        return self._report(result)

    def _fit(self) -> dict:
        t = self.cfg.train
        self.task.check_label_smoothing(self.cfg)
        self.task.check(self.cfg)  # every setting, path and data source, before any folder is created
        dist = self._start()
        if is_run_dir(self.out) and (self.out / RESULTS).is_file():
            return self._already_finished(dist)
        self.trained = dist
        with self.clock.phase("model"):
            state = self._build(dist)
            step = self.parallel.step
        self.clock.warm_steps = 3 if step.cuda_graphs else 2 if step.compiled else 1  # run_report's docstring
        ahead = dist.device.type == "cuda" if self.prefetch is None else self.prefetch
        data = Prefetcher(state.data, self.task.collate, dist.device, ahead=ahead)
        stop = min(t.stop_at, t.steps) if t.stop_at else t.steps
        status = "finished"
        with self.clock.phase("steps"), SignalWatch() as watch, contextlib.closing(RunLog(
                self.out, main=dist.main, log_every=t.log_every, start=state.step, stop=stop,
                progress=t.progress, tensorboard=t.tensorboard)) as log:
            while state.step < stop:
                if dist.agreed_signal(watch.signal) is not None:  # every process stops here
                    status = "interrupted"
                    break
                with self.clock.step(dist.device):
                    tokens = train_step(step, data, state, self.task, t, dist, self.window)
                saving = bool(t.save_every and state.step % t.save_every == 0 and state.step < stop)
                evaluating = bool(t.eval_every and state.step % t.eval_every == 0)
                values = self._settle(dist) if log.due(state.step) or saving or evaluating else None
                with self.clock.phase("evaluations"):
                    metrics = self._evaluate_if_due(state, data, dist)
                log.step(state.step, tokens=tokens, lr=state.scheduler.get_last_lr()[0], values=values,
                         metrics=metrics, memory=distributed.peak_memory(dist.device))
                if t.patience and state.bad_evals >= t.patience:
                    status = "early_stopped"
                    break
                if saving:
                    with self.clock.phase("writing"):
                        self._save(state, data, dist)
            if status == "finished" and state.step < t.steps:
                status = "stopped"
            if t.keep_checkpoints or status not in DONE:
                with self.clock.phase("writing"):
                    self._save(state, data, dist)
            self._settle(dist)
        step.release()
        with self.clock.phase("final_evaluation"):
            return self._finish(state, status, dist.agreed_signal(watch.signal), dist)

    def _report(self, result: dict) -> dict:
        """The run's wall clock (and where its vocabulary is not its preset's) in the log and, for a
        finished run, in ``results.json``, rewritten with them once the rest of it is safe."""
        if not self.trained:  # finished before: its results stand as they are
            return result
        clock = self.clock.report()
        if self.trained.main:  # standard error, with the run's other progress lines (train.progress)
            note(RunClock.line(clock), enabled=self.cfg.train.progress)
        result = {**result, "wall_clock": clock, **({"vocabulary": self.vocab_note} if self.vocab_note else {})}
        if self.trained.main and result.get("status") in DONE and (self.out / RESULTS).is_file():
            write_json_atomic(self.out / RESULTS, result)
        return result

    # ------------------------------------------------------------------ setup
    def _start(self) -> distributed.Dist:
        cache_root()  # a cache setting that names a file: refused before the run's folder is made
        dist = distributed.setup(self.cfg.train.device)
        try:
            resolve_mode(self.cfg.train, dist)  # train.parallel=fsdp on one process: refused before any folder
        except MheError:
            distributed.teardown()
            raise
        if dist.main:
            self._prepare_dir()
        dist.barrier()
        return dist

    def _prepare_dir(self) -> None:
        """The rerun rule: a folder holding a run of another configuration is refused (naming the
        differences and a free folder); one holding an unfinished run of this configuration is
        continued only with ``--resume``; a finished one is reported (:meth:`fit`). Clears a
        killed writer's leftovers."""
        if self.resume and not is_run_dir(self.out):
            raise MheError(f"--resume: there is no run in {self.out} (no {CONFIG}); drop --resume to start one")
        if is_run_dir(self.out):
            self._refuse_another_configuration()
            if not self.resume and not (self.out / RESULTS).is_file():
                last = ckpt.list_checkpoints(self.out / "checkpoints")
                where = f"its newest checkpoint is {last[-1].name}" if last else "no checkpoint yet"
                raise MheError(f"{self.out} holds an unfinished run of this configuration ({where}); pass --resume "
                               f"to continue it or choose another --out ({free_name(self.out)} is free)")
        make_folder(self.out, "--out")
        for path in remove_temporaries(self.out, self.out / "checkpoints"):
            self.log(f"removed {path} (left by an interrupted write)")

    def _refuse_another_configuration(self) -> None:
        old = read_run_record(self.out)["run"]
        if old.get("task") != self.cfg.task:
            diff = f"task: {old.get('task')!r} there, {self.cfg.task!r} now"
        else:
            saved = run_config_from_dict(old, source=self.out / CONFIG, options_of=lambda _: type(self.task).options)
            diff = differences(saved.identity(), self.original.identity()) if saved.hash() != self.cfg_hash else ""
        if diff:
            raise MheError(f"{self.out} holds a run with a different configuration ({diff}); "
                           f"choose another --out ({free_name(self.out)} is free)")

    def _already_finished(self, dist) -> dict:
        result = read_results(self.out)
        if dist.main:
            self.log(f"already finished: results in {self.out}")
        distributed.teardown()
        return result

    def _build(self, dist) -> TrainerState:
        """The model (whole, with a resumed checkpoint's weights), made ready for the steps
        (:func:`~mhe.training.parallelize.parallelize`: ``self.parallel``), then its optimiser and
        the trainer state (a resumed checkpoint's moments, schedule, data position and generators)."""
        t = self.cfg.train
        seed_all(t.seed)
        with self.clock.phase("data"):
            model = self.task.setup(self.cfg, self.out, dist)
        model = model.to(home(t, dist))
        self.vocab_note = vocabulary_note(getattr(self.cfg.model, "vocab_size", None), model.cfg.vocab_size,
                                          self.cfg.preset)
        if self.vocab_note and dist.main:
            note(self.vocab_note, enabled=t.progress)
        if dist.device.type == "cuda":  # full tensor-core tiles; the state dicts keep the real vocabulary
            pad_vocabulary(model)
        if t.epochs > 0:  # the schedule follows the data: epochs x batches per epoch
            per_epoch = max(1, self.task.n_train_items() // t.batch_size)
            t.steps = max(1, math.ceil(t.epochs * per_epoch))
            t.eval_every = t.eval_every or per_epoch
        if dist.main:
            self._write_config(model, dist)
        order = BatchOrder(self.task.n_train_items(), t.batch_size, seed=t.seed, rank=dist.rank, world=dist.world)
        snapshot = self._resume(model, order, dist) if self.resume else None
        if compile_wanted(t, dist.device):  # a later run of the same graphs loads their kernels (mhe.runtime)
            configure_compile_cache()
        say = self.log if dist.main else (lambda _: None)
        self.parallel = parallelize(model, t, dist, static_shapes=self.task.static_shapes, note=say)
        opt, sched = self.parallel.optimizer(t)
        state = TrainerState(opt, sched, order, config_hash=self.cfg_hash)
        if snapshot is not None:
            state.load_state_dict(snapshot)  # FSDP: the full moments sharded as they load
        if dist.main and truncate_metrics(self.out / METRICS, state.step):  # a killed attempt's records
            self.log(f"cut {self.out / METRICS} back to step {state.step}")
        return state

    def _resume(self, model, order: BatchOrder, dist) -> dict | None:
        """Load the newest checkpoint that agrees with the run into the (whole) model; returns its
        trainer state for the optimiser built after the wrapping, or None (nothing to resume, or
        a checkpoint of weights alone)."""
        shapes = saved_shapes(model)  # a padded vocabulary's moments are saved with the real rows
        groups = [g["params"] for g in param_groups(model, self.cfg.train)]
        rejected = []
        found = ckpt.resumable_checkpoint(
            self.out / "checkpoints", model=model, map_location=dist.device, report=self.log, rejected=rejected,
            check=lambda saved, step: state_problem(saved, step, groups=groups, data=order,
                                                    config_hash=self.cfg_hash, shapes=shapes))
        dist.barrier()  # every process has read the folders before they move
        for path, reason in rejected if dist.main else ():  # kept as evidence: a later save never overwrites it
            self.log(f"kept the skipped checkpoint {path.name} aside as {ckpt.set_aside(path, reason)}")
        if found is None:
            self.log(f"no complete checkpoint in {self.out / 'checkpoints'}; starting from step 0")
            return None
        last, weights, snapshot = found
        model.load_state_dict(weights)
        self.last_saved = last
        if dist.main:  # weights alone (mhe convert's step 0): a fresh trainer state on them
            self.log(f"resuming from {last} (step {0 if snapshot is None else snapshot['step']})")
        return snapshot

    def _write_config(self, model, dist) -> None:
        write_run_record(self.out, self.original, model, train=self.cfg.train,
                         device=distributed.device_name(dist.device))

    def _settle(self, dist) -> dict | None:
        """Read the steps since the last read: the last loss and gradient norm, or the stop
        at the first non-finite one."""
        return self.window.read(dist, lambda step, what, value: self._nonfinite(step, what, value))

    def _evaluate_if_due(self, state: TrainerState, data: Prefetcher, dist) -> dict | None:
        """Evaluate every ``eval_every`` steps; a new best score seals its weights in ``best/``."""
        every = self.cfg.train.eval_every
        if not every or state.step % every:
            return None
        self._settle(dist)  # nothing past a non-finite step is evaluated
        data.rewind()
        with self.parallel.full() as full:
            metrics = self._evaluate(full)
            if state.improved(metrics[self.task.metric], self.task.higher_is_better) and dist.main:
                save_best(self.out, full, state.step, state.best)
        return metrics

    def _evaluate(self, model) -> dict:
        model.eval()
        with torch.no_grad(), self._eval_precision(model):
            return self.task.evaluate(model)

    def _eval_precision(self, model):
        """:func:`~mhe.training.step.evaluation_precision` on ``model``'s device."""
        return evaluation_precision(self.cfg, next(model.parameters()).device)

    def _save(self, state: TrainerState, data: Prefetcher, dist) -> None:
        self._settle(dist)  # nothing past a non-finite step is saved
        data.rewind()  # the data position and random generators as the steps left them
        snapshot = state.state_dict()  # FSDP: the optimiser's shards gathered (on every process)
        with self.parallel.full() as full:
            if dist.main:
                self.last_saved = ckpt.save_checkpoint(self.out / "checkpoints", model=full, state=snapshot,
                                                       keep_last=self.cfg.train.keep_last)
        dist.barrier()

    def _nonfinite(self, step, what, value) -> TrainingStopped:
        where = f"last good checkpoint: {self.last_saved}" if self.last_saved else "no checkpoint was saved before it"
        return TrainingStopped(f"non-finite {what} ({value}) at step {step}; stopped; {where}")

    # ------------------------------------------------------------------ end
    def _finish(self, state: TrainerState, status: str, signum: int | None, dist) -> dict:
        """Final evaluation on the best weights and ``results.json`` (finished runs), or the stop report."""
        result = {"status": status, "step": state.step}
        if status == "interrupted":
            result["signal"] = signum
            if dist.main:
                self.log(f"interrupted at step {state.step}; checkpoint saved to {self.last_saved}; "
                         "continue with --resume")
        if status in DONE:
            state.optimizer.state.clear()  # the moments are saved or done with: room for FSDP's gathered copy
            with self.parallel.full() as full:  # FSDP: the gathered weights
                if state.best is not None and has_best(self.out):
                    load_best(self.out, full)
                if dist.main:
                    which = f"the best weights (step {state.best_step})" if state.best is not None else f"step {state.step}"
                    note(f"final evaluation ({self.task.name}) of {which}", enabled=self.cfg.train.progress)
                with torch.no_grad(), self._eval_precision(full):  # as the periodic evaluations run
                    final = self.task.final(full)
                result = {"step": state.step, **self._summary(full, state.step, status), **final}
            if dist.main:
                write_json_atomic(self.out / RESULTS, result)
                if not self.cfg.train.keep_checkpoints:  # the results are safe: free the disk (sweeps of short runs)
                    for sub in ("checkpoints", BEST):
                        shutil.rmtree(self.out / sub, ignore_errors=True)
        dist.barrier()
        distributed.teardown()
        return result

    def _summary(self, model, step, status) -> dict:
        return {"task": self.task.name, "metric": self.task.metric, "higher_is_better": self.task.higher_is_better,
                "attention": self.cfg.model.attention, "preset": self.cfg.preset, "seed": self.cfg.train.seed,
                "attention_params": count_attention_params(model),
                "total_params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
                - padding_numel(model),
                "steps": step, "status": status, "config_hash": self.cfg_hash}
