"""The captured decode step and what every decode session shares: a step run eagerly, replayed
as a CUDA graph, or compiled by ``torch.compile`` and replayed; the one policy that picks the
mode; the undo of a capture's warm-ups; and the one check of non-finite logits.

A step reads and writes only tensors (a static :class:`~mhe.attention.kv_cache.KVCache`, the
token state of :mod:`mhe.generation.sampling`, a mask built from the cache's write position), so
the same graph serves every token. :class:`StepRunner` runs it in one of the
:data:`STEP_MODES`: ``eager``; ``graph``, captured once with ``torch.cuda.graph`` and replayed
(the same kernels as eager, so the output is bit-identical); ``compile``, compiled once by
``torch.compile`` (inductor fuses the elementwise work: norm with residual, bias with
activation, the cache writes) and, on CUDA, captured in the same kind of graph, so a replay
launches the fused kernels with no host work. ``auto`` is the policy's entry of
:data:`CUDA_MODES` on CUDA and ``eager`` elsewhere.

What the step runs on (the inference view of the model, and the decode plan passed down its
calls) belongs to the attention package: :func:`mhe.attention.folding.inference_view`,
:func:`mhe.attention.kernels.decode_plan`. The two policies of a decode session, sampling
(:mod:`mhe.generation.session`) and beam search (:mod:`mhe.generation.beam`), build their steps here.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
import warnings
from typing import Callable, Sequence

import torch

from mhe.compile_fallback import run_or_fall_back
from mhe.errors import MheError, one_of

STEP_MODES = ("auto", "eager", "graph", "compile")

CUDA_MODES = {"sample": "compile", "beam": "graph"}
"""What step mode ``auto`` means on CUDA, by policy. Generation (``model.generate``, the sampling
path, ``mhe generate``, the Hugging Face adapter's ``generate``) takes ``compile``: the step
compiled by inductor and replayed as one CUDA graph with the choice of the next token, over
``graph`` (the same step's eager kernels replayed); both are measured side by side, per kind and
size, by ``benchmarks/decode.py speed`` (docs/benchmarks.md), which this choice follows. Beam
search takes ``graph``: its fp32 output must equal the eager search's, which inductor's
reordered arithmetic does not promise; ``step_mode="compile"`` fuses its step and captures it
the same way."""


ONE_ROW_COMPILE_OPTIONS = {"options": {"coordinate_descent_tuning": True}}
"""What a compiled decode step of one row on CUDA is given when its caller gives no
``compile_options``. With coordinate-descent tuning inductor writes a one-row matrix product
without a bias (every Llama-style projection) as a tuned Triton reduction that it can fuse with
its neighbours, where cuBLAS launches one kernel a product (gpt-fast's batch-1 recipe). At 64
rows no product qualifies and the tuning only costs compile time, so the default is for one
row; docs/benchmarks.md section 12 times both. Every step compiled with this tuning times its
candidates by their device kernel time (:func:`kernel_time_tuning`)."""

KERNEL_TIME_TUNING = True
"""Whether a step compiled with coordinate-descent tuning has inductor's autotuner time each
candidate launch configuration by the kernel's device time (the profiler's clock) instead of its
event clock. For the ~3 us one-row products the event clock reads 5-26 times the kernel's time,
so its pick varied from compile to compile (llama-135m MHA at batch 1: the SwiGLU product 74.5
to 135.2 us a token); timed by the kernel, two fresh compiles picked the same configuration and
took 0.818 and 0.819 ms a token against 0.850 and 0.900 (``decode.py tuning``,
docs/benchmarks.md)."""


_TUNING_LOCK = threading.Lock()
_TUNING_USERS = [0, None]  # blocks inside kernel_time_tuning now, and the bench they replaced


@contextlib.contextmanager
def kernel_time_tuning(on: bool = True):
    """While the block runs, inductor's autotuner (``CachingAutotuner.bench``) times candidates by
    their device kernel time (``with_profiler=True``) whatever its caller asked; nothing when
    ``on`` is false, or where this torch's autotuner has no such clock (a CPU build without
    Triton, or a torch whose ``bench`` lacks the keyword). The method is replaced on the class,
    for the whole process, by the first of overlapping blocks (threads compiling at once) and put
    back by the last, so overlapping blocks never leave it replaced."""
    tuner = _autotuner() if on else None
    if tuner is None:
        yield
        return
    with _TUNING_LOCK:
        if _TUNING_USERS[0] == 0:
            bench = tuner.bench

            def by_kernel_time(self, launcher, *args, with_profiler=False, **kwargs):
                return bench(self, launcher, *args, with_profiler=True, **kwargs)
            _TUNING_USERS[1], tuner.bench = bench, by_kernel_time
        _TUNING_USERS[0] += 1
    try:
        yield
    finally:
        with _TUNING_LOCK:
            _TUNING_USERS[0] -= 1
            if _TUNING_USERS[0] == 0:
                tuner.bench, _TUNING_USERS[1] = _TUNING_USERS[1], None


def _autotuner():
    """Inductor's ``CachingAutotuner`` when its ``bench`` takes ``with_profiler``, else None."""
    try:
        from torch._inductor.runtime.triton_heuristics import CachingAutotuner
    except ImportError:
        return None
    try:
        takes = "with_profiler" in inspect.signature(CachingAutotuner.bench).parameters
    except (AttributeError, TypeError, ValueError):
        return None
    return CachingAutotuner if takes else None


COMPILE_KEYS = ("mode", "options", "backend", "disable")
"""``torch.compile``'s keywords a caller may set through ``compile_options`` (``fullgraph`` and
``dynamic`` are the step's own)."""
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def check_compile_options(given) -> dict | None:
    """``given`` when it is None or a dict of :data:`COMPILE_KEYS` (``mode`` one of
    :data:`COMPILE_MODES`, ``options`` a dict of inductor settings, ``backend`` a name or callable,
    ``disable`` a bool); anything else is a one-line :class:`MheError` naming the bad part and
    what is allowed, before any compilation (not torch's traceback at the first step)."""
    if given is None:
        return None
    if not isinstance(given, dict):
        raise MheError(f"compile_options must be a dict of torch.compile keywords ({', '.join(COMPILE_KEYS)}), "
                       f"got {type(given).__name__} {given!r}")
    bad = [k for k in given if k not in COMPILE_KEYS]
    if bad:
        raise MheError(f"compile_options has no key {bad[0]!r}; valid: {', '.join(COMPILE_KEYS)} (fullgraph and "
                       "dynamic are fixed by the decode step)")
    if "mode" in given and given["mode"] not in COMPILE_MODES:
        raise one_of("compile_options mode", given["mode"], COMPILE_MODES)
    if "options" in given and not isinstance(given["options"], dict):
        raise MheError(f"compile_options['options'] must be a dict of inductor settings, got "
                       f"{type(given['options']).__name__}")
    if "backend" in given and not (isinstance(given["backend"], str) or callable(given["backend"])):
        raise MheError(f"compile_options['backend'] must be a backend name or callable, got {given['backend']!r}")
    if "disable" in given and not isinstance(given["disable"], bool):
        raise MheError(f"compile_options['disable'] must be true or false, got {given['disable']!r}")
    return given


def default_compile_options(rows: int, device: torch.device, given: dict | None) -> dict | None:
    """``given``, or, where the caller gave none, :data:`ONE_ROW_COMPILE_OPTIONS` for a step of
    one row on CUDA (None otherwise: inductor's defaults)."""
    if given is not None or rows != 1 or device.type != "cuda":
        return given
    return {"options": dict(ONE_ROW_COMPILE_OPTIONS["options"])}


def resolve_mode(mode: str, device: torch.device, policy: str = "sample") -> str:
    """The mode a step of ``policy`` (``sample`` or ``beam``) runs in on ``device``: ``auto`` is
    :data:`CUDA_MODES`'s entry on CUDA, ``eager`` elsewhere; ``graph`` needs CUDA (elsewhere it is
    ``eager``)."""
    if mode not in STEP_MODES:
        raise one_of("decode step mode", mode, STEP_MODES)
    if mode == "auto":
        return CUDA_MODES[policy] if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        return "eager"  # CUDA graphs need a CUDA device
    return mode


class StepRunner:
    """Calls ``step(*inputs) -> tensor`` through fixed input/output tensors.

    Args:
        step: the decode step; it may mutate caches and other state in place.
        inputs: example inputs (copied into the runner's own tensors on each call).
        mode: ``eager``, ``graph`` or ``compile`` (see the module docstring): ``compile``
            compiles the whole step (:func:`compile_step`); ``graph`` and ``compile`` capture it
            as a CUDA graph on a CUDA ``device``.
        compile_options: passed to ``torch.compile`` in ``compile`` mode.
        before_warmup: called before each warm-up run of a capture, to undo what a previous
            run changed (the caches' write position); the step's effects are the same on
            replay, so a warm-up is harmless once undone.
        generators: the ``torch.Generator`` objects the step draws from besides the device's
            default one; a capture registers them with the graph, so each replay draws the
            numbers an eager run would, and puts their state (and the default generator's)
            back after the warm-ups.
    """

    def __init__(self, step: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor] = (), *, mode: str,
                 before_warmup: Callable[[], None] | None = None, compile_options: dict | None = None,
                 device: torch.device | None = None, generators: Sequence[torch.Generator] = ()) -> None:
        self.mode = mode
        device = torch.device(device) if device is not None else inputs[0].device
        self.inputs = [t.clone() for t in inputs]
        self.step = compile_step(step, device=device, options=compile_options) if mode == "compile" else step
        self.capture = device.type == "cuda" and mode in ("graph", "compile")
        self.device = device
        self.generators = list(generators)
        self._graph = None
        self._out: torch.Tensor | None = None
        self._before = before_warmup or (lambda: None)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(self.inputs, inputs):
            dst.copy_(src)
        if not self.capture:
            return self.step(*self.inputs)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._out

    def _capture(self) -> None:
        saved = [t.clone() for t in self.inputs]
        rng = [(g, g.get_state()) for g in self.generators]
        default_rng = torch.cuda.get_rng_state(self.device)
        torch.cuda.synchronize(self.device)
        side = torch.cuda.Stream(device=self.device)  # the warm-ups and the capture run on the step's card
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # the first run compiles (compile mode) and plans kernels
                self._before()
                self.step(*self.inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._before()
        for g, state in rng:
            g.set_state(state)
        torch.cuda.set_rng_state(default_rng, self.device)
        graph = torch.cuda.CUDAGraph()
        if self.generators and not hasattr(graph, "register_generator_state"):
            raise MheError("sampling with a seed inside a captured step needs torch >= 2.5; use step_mode='eager'")
        for g in self.generators:
            graph.register_generator_state(g)
        # on ``side``: torch.cuda.graph's default capture stream is made once a process, on the card
        # current then, and a capture on it makes that card current (a step on another card then
        # launched its Triton kernels against the wrong card's context)
        with torch.cuda.graph(graph, stream=side):
            self._out = self.step(*self.inputs)
        for dst, src in zip(self.inputs, saved):
            dst.copy_(src)
        self._graph = graph


def compile_step(step: Callable[..., torch.Tensor], *, device: torch.device,
                 options: dict | None = None, what: str = "decode step") -> Callable[..., torch.Tensor]:
    """``step`` compiled once by ``torch.compile`` (``fullgraph``, static shapes; ``options``
    added), to be captured in the runner's own CUDA graph (so not in inductor's: no
    ``reduce-overhead`` here).

    Each call compiles its own copy of ``step``'s code object, so dynamo's cache of compiled
    graphs (and its limit of 8 per code object) belongs to this step and goes with it: a process
    that decodes with many models or shapes never falls back to eager. If compilation fails
    (no working compiler, an operator inductor cannot lower), one warning says so and the step
    runs its eager kernels, as the trainer does (:mod:`mhe.compile_fallback`); ``what`` names the
    step in that warning (``decode step``, ``prefill``)."""
    opts = dict(check_compile_options(options) or {})
    if device.type == "cuda" and opts.get("mode") in ("reduce-overhead", "max-autotune"):
        raise MheError(f"compile_options mode {opts['mode']!r} captures CUDA graphs of its own; the decode step "
                       "is captured as one graph already: use 'default' or 'max-autotune-no-cudagraphs'")
    own = step
    if isinstance(step, types.FunctionType):
        own = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                                 step.__closure__)
    tuned = device.type == "cuda" and bool((opts.get("options") or {}).get("coordinate_descent_tuning"))
    return _CompiledStep(torch.compile(own, fullgraph=True, dynamic=False, **opts), step,
                         kernel_time=tuned and KERNEL_TIME_TUNING, what=what)


class _CompiledStep:
    """The compiled step, or, once its compilation failed, the eager one (see :func:`compile_step`).
    With ``kernel_time`` its first call, where inductor compiles and tunes the step's kernels,
    runs under :func:`kernel_time_tuning`."""

    def __init__(self, compiled: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor], *,
                 kernel_time: bool = False, what: str = "decode step") -> None:
        self.run, self.eager, self.proven, self.kernel_time = compiled, eager, False, kernel_time
        self.what = what  # what the warning of a failed compile calls it

    @property
    def fell_back(self) -> bool:
        """Compiling failed and the step runs its eager kernels."""
        return self.run is self.eager

    def __call__(self, *args):
        if self.proven:
            return self.run(*args)

        def eager(error: Exception, why: str) -> torch.Tensor:
            warnings.warn(f"torch.compile cannot compile this {self.what} ({why}); it runs its eager kernels",
                          RuntimeWarning, stacklevel=4)  # the step's caller
            self.run = self.eager
            return self.run(*args)
        with kernel_time_tuning(self.kernel_time):
            out = run_or_fall_back(lambda: self.run(*args), eager)
        self.proven = True
        return out


def restorer(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A function that puts ``tensors`` (the caches' write positions, a token state) back to
    their values now (after a warm-up run of a step that advanced them)."""
    saved = [t.clone() for t in tensors]

    def restore() -> None:
        for t, s in zip(tensors, saved):
            t.copy_(s)
    return restore


def note_non_finite(first: torch.Tensor, broken: torch.Tensor, step: torch.Tensor) -> None:
    """Record in ``first`` (0-d, -1 while none was) ``step`` if ``broken`` (0-d bool) and no earlier
    step was: on the device, no host read, so it runs inside a captured step."""
    first.copy_(torch.where((first < 0) & broken, step, first))


def refuse_non_finite(first: torch.Tensor, what: Callable[[int], str], consequence: str) -> None:
    """Refuse a call whose logits were not finite at some step (``first`` >= 0, read once a call):
    one line, ``what(step)`` naming the step, then ``consequence`` (a token chosen from NaN is noise)."""
    step = int(first)
    if step >= 0:
        raise MheError(f"{what(step)} are not finite (NaN or inf): the model's weights or activations are; "
                       f"{consequence}")


class RunnerCache:
    """The captured steps a session keeps, by key, at most ``size`` (the least recently used goes):
    capturing costs far more than a step, so a session reuses them across calls."""

    def __init__(self, size: int) -> None:
        self.size, self.runners = size, {}

    def get(self, key, build: Callable[[], "StepRunner"]) -> "StepRunner":
        run = self.runners.pop(key, None)  # re-inserted: the newest last
        if run is None:
            if len(self.runners) >= self.size:
                self.runners.pop(next(iter(self.runners)))
            run = build()
        self.runners[key] = run
        return run

    def clear(self) -> None:
        self.runners = {}

    def drop(self, which: Callable[[object], bool]) -> None:
        """Forget the steps whose key ``which`` accepts (their buffers are gone)."""
        self.runners = {k: r for k, r in self.runners.items() if not which(k)}
