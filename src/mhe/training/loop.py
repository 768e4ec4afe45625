"""The one training loop every task uses.

AdamW with LambdaLR schedules, gradient accumulation and clipping, bf16
autocast on GPU (fp32 on CPU), optional ``torch.compile``, evaluation every N
steps with early stopping, atomic checkpoints with exact resume, SIGINT/SIGTERM
handling, DDP under ``torchrun`` with the same global batch as one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math

import shutil
import signal
import sys
import time
from pathlib import Path

import torch

from mhe.accounting import count_attention_params
from mhe.errors import MheError
from mhe.training import checkpoint as ckpt
from mhe.training import distributed
from mhe.training.batches import BatchOrder
from mhe.training.config import RunConfig
from mhe.training.optim import build_optimizer
from mhe.training.task import Task


class TrainingStopped(MheError):
    """The run stopped itself (non-finite loss); the message says where and what is left."""


def seed_all(seed: int) -> None:
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2 ** 32))
    torch.manual_seed(seed)


class Trainer:
    def __init__(self, cfg: RunConfig, task: Task, out: str | Path, *, resume: bool = False,
                 log=print) -> None:
        self.cfg, self.task, self.out, self.resume, self.log = cfg, task, Path(out), resume, log
        self._signal: int | None = None

    # ------------------------------------------------------------------ setup
    def _prepare_dir(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        cfg_path = self.out / "config.json"
        if cfg_path.exists():
            from mhe.training.config import RunConfig as RC

            old = RC.from_dict(json.loads(cfg_path.read_text())["run"])
            if old.hash() != self.cfg_hash:
                diff = _diff(old.identity(), self.original.identity())
                raise MheError(f"{self.out} holds a run with a different configuration ({diff}); "
                               "choose another --out")
            if not self.resume and (self.out / "checkpoints").exists() and ckpt.list_checkpoints(self.out / "checkpoints"):
                raise MheError(f"{self.out} already holds checkpoints; pass --resume to continue it or choose another --out")

    def _write_config(self, model) -> None:
        ckpt.write_json_atomic(self.out / "config.json", {
            "run": self.original.to_dict(), "resolved_train": dataclasses.asdict(self.cfg.train),
            "model": model.cfg.to_dict(), "config_hash": self.cfg_hash,
            "attention_params": count_attention_params(model), "torch": torch.__version__,
            "device": _device_name(next(model.parameters()).device),
        })

    def _precision(self, device: torch.device) -> torch.dtype | None:
        p = self.cfg.train.precision
        if p == "bf16" or (p == "auto" and device.type == "cuda"):
            return torch.bfloat16
        return None

    # ------------------------------------------------------------------ run
    def fit(self) -> dict:
        import copy

        self.original = copy.deepcopy(self.cfg)  # what the user asked for: hashed and saved
        self.cfg_hash = self.original.hash()
        t = self.cfg.train
        dist = distributed.setup(t.device)
        main = dist.main
        if main:
            self._prepare_dir()
        dist.barrier()
        seed_all(t.seed)
        model = self.task.setup(self.cfg, self.out, dist).to(dist.device)
        if t.epochs > 0:  # the schedule follows the data: epochs x batches per epoch
            per_epoch = max(1, self.task.n_train_items() // t.batch_size)
            t.steps = max(1, math.ceil(t.epochs * per_epoch))
            if t.eval_every == 0:
                t.eval_every = per_epoch
        if main:
            self._write_config(model)
        opt, sched = build_optimizer(model, t)
        order = BatchOrder(self.task.n_train_items(), t.batch_size, seed=t.seed, rank=dist.rank, world=dist.world)
        step, best, bad_evals = 0, None, 0
        ckpt_dir = self.out / "checkpoints"
        if self.resume:
            last = ckpt.latest_checkpoint(ckpt_dir, report=self.log)
            if last is None:
                self.log(f"no complete checkpoint in {ckpt_dir}; starting from step 0")
            else:
                state = ckpt.load_checkpoint(last, model=model, optimizer=opt, scheduler=sched,
                                             map_location=dist.device)
                if state.get("config_hash") != self.cfg_hash:
                    raise MheError(f"checkpoint {last} belongs to a different configuration")
                step, best, bad_evals = state["step"], state.get("best"), state.get("bad_evals", 0)
                order.load_state_dict(state["data"])
                if main:
                    self.log(f"resuming from {last} (step {step})")
                    _truncate_metrics(self.out / "metrics.jsonl", step)
        amp = self._precision(dist.device)
        net = model
        if t.compile:
            net = torch.compile(model)
        if dist.world > 1:
            net = torch.nn.parallel.DistributedDataParallel(net, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None)
        stop = min(t.stop_at, t.steps) if t.stop_at else t.steps
        status = "finished"
        tb = _tensorboard(self.out) if (t.tensorboard and main) else None
        bar = _progress(step, stop) if (t.progress and main) else None
        self._install_signals()
        last_good = None
        try:
            tokens, t0 = 0, time.perf_counter()
            while step < stop:
                if self._signal is not None:
                    status = "interrupted"
                    break
                model.train()
                loss_sum, n_tok = 0.0, 0
                for micro in range(t.grad_accum):
                    batch = self.task.to(self.task.collate(order.next()), dist.device)
                    sync = micro == t.grad_accum - 1 or dist.world == 1
                    ctx = net.no_sync() if (dist.world > 1 and not sync) else contextlib.nullcontext()
                    with ctx, torch.autocast(dist.device.type, dtype=amp, enabled=amp is not None):
                        loss, n = self.task.loss(net, batch)
                    if not torch.isfinite(loss):
                        raise self._nonfinite(step + 1, "loss", loss.item(), last_good)
                    (loss / t.grad_accum).backward()
                    loss_sum += loss.item() / t.grad_accum
                    n_tok += n
                gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm if t.clip_norm > 0 else float("inf"))
                if not torch.isfinite(gnorm):
                    raise self._nonfinite(step + 1, "gradient norm", gnorm.item(), last_good)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                tokens += n_tok * dist.world
                loss_mean = dist.all_mean(loss_sum)
                record = None
                if main and (step % t.log_every == 0 or step == stop):
                    dt = time.perf_counter() - t0
                    record = {"step": step, "loss": loss_mean, "lr": sched.get_last_lr()[0],
                              "grad_norm": float(gnorm), "tokens_per_s": tokens / dt if dt > 0 else 0.0}
                    tokens, t0 = 0, time.perf_counter()
                if t.eval_every and step % t.eval_every == 0:
                    metrics = self._evaluate(model)
                    record = {**(record or {"step": step, "loss": loss_mean}), **metrics}
                    score = metrics[self.task.metric]
                    if best is None or (score > best if self.task.higher_is_better else score < best):
                        best, bad_evals = score, 0
                        if main:
                            _save_best(self.out, model, step, score)
                    else:
                        bad_evals += 1
                if record is not None and main:
                    _append_jsonl(self.out / "metrics.jsonl", record)
                    if tb is not None:
                        for k, v in record.items():
                            if k != "step" and isinstance(v, (int, float)):
                                tb.add_scalar(k, v, step)
                if bar is not None:
                    bar.update(1)
                    rate = bar.format_dict.get("rate") or 0.0  # steps per second
                    bar.set_postfix(loss=f"{loss_mean:.4f}", tok_s=f"{rate * n_tok * dist.world:,.0f}", refresh=False)
                save_now = t.save_every and step % t.save_every == 0
                if t.patience and bad_evals >= t.patience:
                    status = "early_stopped"
                    save_now = True
                if save_now and step < stop:
                    last_good = self._save(model, opt, sched, order, step, best, bad_evals, dist)
                if status == "early_stopped":
                    break
            if status == "finished" and step < t.steps:
                status = "stopped"
            if t.keep_checkpoints or status not in ("finished", "early_stopped"):
                last_good = self._save(model, opt, sched, order, step, best, bad_evals, dist)
            if status == "interrupted" and main:
                self.log(f"interrupted at step {step}; checkpoint saved to {last_good}; continue with --resume")
        finally:
            self._restore_signals()
            if bar is not None:
                bar.close()
            if tb is not None:
                tb.close()
        result = {"status": status, "step": step}
        if status in ("finished", "early_stopped"):
            if best is not None and (self.out / "best" / "model.safetensors").exists():
                _load_best(self.out, model)
            final = self.task.final(model)
            result = {"step": step, **self._summary(model, step, status), **final}
            if main:
                ckpt.write_json_atomic(self.out / "results.json", result)
                if not t.keep_checkpoints:  # the results are safe: free the disk (sweeps of short runs)
                    for sub in ("checkpoints", "best"):
                        shutil.rmtree(self.out / sub, ignore_errors=True)
        dist.barrier()
        distributed.teardown()
        return result

    # ------------------------------------------------------------------ pieces
    def _evaluate(self, model) -> dict:
        model.eval()
        with torch.no_grad():
            return self.task.evaluate(model)

    def _summary(self, model, step, status) -> dict:
        return {"task": self.task.name, "metric": self.task.metric, "higher_is_better": self.task.higher_is_better,
                "attention": self.cfg.model.attention, "preset": self.cfg.preset, "seed": self.cfg.train.seed,
                "attention_params": count_attention_params(model),
                "total_params": sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()),
                "steps": step, "status": status, "config_hash": self.cfg_hash}

    def _save(self, model, opt, sched, order, step, best, bad_evals, dist) -> Path | None:
        if not dist.main:
            dist.barrier()
            return None
        path = ckpt.save_checkpoint(self.out / "checkpoints", step, model=model, optimizer=opt, scheduler=sched,
                                    trainer_state={"data": order.state_dict(), "best": best, "bad_evals": bad_evals,
                                                   "config_hash": self.cfg_hash},
                                    keep_last=self.cfg.train.keep_last)
        dist.barrier()
        return path

    def _nonfinite(self, step, what, value, last_good) -> TrainingStopped:
        where = f"last good checkpoint: {last_good}" if last_good else "no checkpoint was saved before it"
        return TrainingStopped(f"non-finite {what} ({value}) at step {step}; stopped; {where}")

    def _install_signals(self) -> None:
        self._old = {}
        if sys.platform.startswith("win"):
            return
        import threading

        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._on_signal)

    def _restore_signals(self) -> None:
        for sig, handler in getattr(self, "_old", {}).items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        if self._signal is not None:  # a second signal: stop now
            raise KeyboardInterrupt
        self._signal = signum


def _device_name(device: torch.device) -> str:
    """The card a run trained on, for the record (results must name it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def _diff(a: dict, b: dict, prefix="") -> str:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            d = _diff(va, vb, f"{prefix}{k}.")
            if d:
                out.append(d)
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} there, {vb!r} now")
    return "; ".join(out)


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop records logged after the checkpoint being resumed, so no step appears twice."""
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def _save_best(out: Path, model, step, score) -> None:
    from safetensors.torch import save_file

    best = out / "best"
    best.mkdir(exist_ok=True)
    tmp = best / ".model.safetensors.tmp"
    save_file({k: v.detach().cpu().contiguous().clone() for k, v in model.state_dict().items()}, str(tmp))
    tmp.replace(best / "model.safetensors")
    ckpt.write_json_atomic(best / "best.json", {"step": step, "score": score})


def _load_best(out: Path, model) -> None:
    from safetensors.torch import load_file

    state = load_file(str(out / "best" / "model.safetensors"))
    model.load_state_dict(state, strict=False)


def _progress(start, total):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0, leave=False)


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise MheError("train.tensorboard=true needs the optional 'tensorboard' package") from None
    return SummaryWriter(str(out / "tensorboard"))


