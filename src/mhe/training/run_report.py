"""What a run says about itself at its end: where its wall clock went, and its vocabulary.

A user waits for the whole command, not for the steps alone: before the first step a run reads
its corpus, trains (or reuses) a tokenizer, tokenizes, builds the model, and compiles and captures
the step; after the last it evaluates the best weights and writes. :class:`RunClock` splits the
run's wall time into those phases (``PHASES``) and the trainer prints it and stores it in
``results.json`` as ``wall_clock``, with the time to the first step.

Phases are exclusive: time spent in a phase opened inside another (the tokenizer inside the task's
data preparation) counts for the inner one only. Code below the trainer (the tasks) marks its
phases with :func:`phase`, which times into the clock of the run in progress, if any.

Compilation and graph capture are not separate calls: ``torch.compile`` compiles inside the first
forward and backward, and CUDA graphs (``mode="reduce-overhead"``) are recorded at the step after
it. So the first ``warm_steps`` steps are timed to the device (one synchronisation each), and
whatever they took beyond the same number of later steps at the run's steady step time is
reported as ``compile`` (compilation and graph capture); the rest is ``steps``.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch

PHASES = {
    "startup": "start-up",
    "tokenizer": "tokenizer",
    "data": "data",
    "model": "model",
    "compile": "compilation and graph capture",
    "steps": "steps",
    "evaluations": "evaluations",
    "writing": "writing",
    "final_evaluation": "final evaluation",
}
"""Each phase's key in ``results.json`` and its words in the run log."""

_ACTIVE: list["RunClock"] = []
_FIRST_RUN = [True]  # the first run of a process counts its start-up from the process's start
_IMPORTED = time.monotonic()


def process_age() -> float:
    """Seconds since this process started (Linux: from ``/proc``; elsewhere, or where that reading is
    not between the time since this module's import and an hour more, since the import, which
    misses part of the interpreter's and torch's import time)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        age = -1.0
    since_import = time.monotonic() - _IMPORTED
    return age if since_import <= age < since_import + 3600 else since_import  # a clock that disagrees: the import


@contextlib.contextmanager
def phase(name: str):
    """Time the block into phase ``name`` of the run in progress (nothing outside a run)."""
    if not _ACTIVE:
        yield
        return
    with _ACTIVE[-1].phase(name):
        yield


class RunClock:
    """The wall clock of one run, by phase (see the module docstring). ``warm_steps``: the steps
    timed to the device whose time beyond the steady step time is compilation and graph capture."""

    def __init__(self, *, warm_steps: int = 1) -> None:
        now = time.monotonic()
        first, _FIRST_RUN[0] = _FIRST_RUN[0], False
        self.origin = now - process_age() if first else now
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds["startup"] = now - self.origin
        self.warm_steps = warm_steps
        self.first_step_s: float | None = None
        self._stack: list[list] = []  # [name, start, time in phases opened inside it]
        self._warm = 0.0  # the warm-up steps' time, to the device
        self._steps = 0

    @contextlib.contextmanager
    def running(self):
        """Make this the clock :func:`phase` times into."""
        _ACTIVE.append(self)
        try:
            yield self
        finally:
            _ACTIVE.remove(self)

    @contextlib.contextmanager
    def phase(self, name: str):
        if name not in PHASES:
            raise KeyError(name)
        entry = [name, time.monotonic(), 0.0]
        self._stack.append(entry)
        try:
            yield
        finally:
            self._stack.pop()
            took = time.monotonic() - entry[1]
            self.seconds[name] += took - entry[2]
            if self._stack:
                self._stack[-1][2] += took

    @contextlib.contextmanager
    def step(self, device: torch.device):
        """One optimiser step (inside the ``steps`` phase the loop opens); the first ``warm_steps``
        wait for the device, so their time is known."""
        start = time.monotonic()
        yield
        self._steps += 1
        if self._steps <= self.warm_steps:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.monotonic()
            self._warm += now - start
            if self._steps == 1:
                self.first_step_s = now - self.origin

    def _split_steps(self) -> None:
        """Move the warm-up steps' time beyond the steady step time from ``steps`` to ``compile``."""
        if not self._steps or self.seconds["compile"]:
            return
        warm_steps = min(self._steps, self.warm_steps)
        later = self._steps - warm_steps
        steady = max(0.0, self.seconds["steps"] - self._warm) / later if later else 0.0
        extra = max(0.0, self._warm - warm_steps * steady) if later else self._warm
        self.seconds["compile"], self.seconds["steps"] = extra, self.seconds["steps"] - extra

    def report(self) -> dict:
        """``{"total_s", "time_to_first_step_s", <phase>_s..., "other_s"}`` rounded to 0.01 s."""
        self._split_steps()
        total = time.monotonic() - self.origin
        out = {"total_s": round(total, 3), "time_to_first_step_s":
               None if self.first_step_s is None else round(self.first_step_s, 3)}
        out.update({f"{k}_s": round(v, 3) for k, v in self.seconds.items()})
        out["other_s"] = round(max(0.0, total - sum(self.seconds.values())), 3)
        return out

    @staticmethod
    def line(report: dict) -> str:
        """The run log's line for :meth:`report`'s dict."""
        parts = [f"{words} {report[key + '_s']:.1f}" for key, words in PHASES.items()]
        first = report["time_to_first_step_s"]
        return (f"wall clock {report['total_s']:.1f} s: " + ", ".join(parts) + f", other {report['other_s']:.1f}"
                + ("" if first is None else f"; first step done {first:.1f} s after the process started"))


def vocabulary_note(preset_vocab: int | None, model_vocab: int, preset: str) -> str | None:
    """One line where the model's vocabulary (its tokenizer's) is not the preset's own size (a
    preset names the vocabulary of the released model it copies; a run trains its tokenizer on its
    corpus, e.g. llama-135m's 49,152 against a byte-level BPE of at most 50,257), else None."""
    if not preset_vocab or preset_vocab == model_vocab:
        return None
    return (f"vocabulary: {model_vocab:,} entries (the run's tokenizer's), not the {preset_vocab:,} of preset {preset}: "
            "the embedding and output layers have the tokenizer's size")
