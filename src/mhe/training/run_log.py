"""What a run reports while it trains: ``metrics.jsonl``, TensorBoard and the progress bar,
and the signal watch that turns SIGINT/SIGTERM into a clean stop."""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path

from mhe.errors import MheError
from mhe.progress import counter
from mhe.training.run_files import METRICS, append_metrics


class RunLog:
    """Writes one record per ``log_every`` steps (and at evaluations) on the main process."""

    def __init__(self, out: Path, *, main: bool, log_every: int, start: int, stop: int, progress: bool,
                 tensorboard: bool) -> None:
        self.path, self.main, self.log_every, self.stop = out / METRICS, main, log_every, stop
        self.tb = _tensorboard(out) if (tensorboard and main) else None
        self.bar = _progress(start, stop) if (progress and main) else None
        self.tokens, self.steps, self.t0 = 0, 0, time.perf_counter()

    def due(self, step: int) -> bool:
        """Whether ``step`` ends a log interval (the trainer reads the loss there)."""
        return step % self.log_every == 0 or step == self.stop

    def step(self, step: int, *, tokens: int, lr: float, values: dict | None, metrics: dict | None,
             memory: float | None = None) -> None:
        """Account one optimiser step; ``values`` (loss, grad_norm) are given where the trainer
        read them (every :meth:`due` step), ``metrics`` where an evaluation ran, ``memory`` the
        peak GiB of a CUDA device."""
        self.tokens, self.steps = self.tokens + tokens, self.steps + 1
        record = None
        if self.main and self.due(step):
            dt = time.perf_counter() - self.t0
            record = {"step": step, **(values or {}), "lr": lr, "tokens_per_s": self.tokens / dt if dt > 0 else 0.0,
                      "step_s": dt / self.steps}
            if memory is not None:
                record["max_mem_gib"] = memory
            self.tokens, self.steps, self.t0 = 0, 0, time.perf_counter()
        if metrics is not None:
            record = {**(record or {"step": step, **(values or {})}), **metrics}
        if record is not None and self.main:
            append_metrics(self.path, record)
            if self.tb is not None:
                for k, v in record.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self.tb.add_scalar(k, v, step)
        if self.bar is not None:
            self.bar.update(1)
            if values is not None:
                rate = self.bar.format_dict.get("rate") or 0.0  # steps per second
                self.bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{rate * tokens:,.0f}", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()


class SignalWatch:
    """While active, the first SIGINT/SIGTERM is recorded (the loop stops at the next step,
    saves and reports it); a second one stops at once with ``KeyboardInterrupt``. The same
    signal again within ``REPEAT_S`` seconds counts as the first: Ctrl-C in a terminal reaches
    the processes of a ``torchrun`` from the terminal and again from torchrun, which forwards it."""

    REPEAT_S = 1.0

    def __init__(self) -> None:
        self.signal: int | None = None
        self._at = 0.0
        self._old: dict = {}

    def __enter__(self) -> "SignalWatch":
        if not sys.platform.startswith("win") and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def _on_signal(self, signum, frame) -> None:
        if self.signal is not None:
            if signum == self.signal and time.monotonic() - self._at < self.REPEAT_S:
                return
            raise KeyboardInterrupt
        self.signal, self._at = signum, time.monotonic()


def _progress(start, total):
    """The step bar: tqdm on a terminal, whole lines elsewhere (:func:`mhe.progress.counter`)."""
    return counter(total, desc="training", unit="step", initial=start)


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise MheError("train.tensorboard=true needs the optional 'tensorboard' package") from e
    return SummaryWriter(str(out / "tensorboard"))
