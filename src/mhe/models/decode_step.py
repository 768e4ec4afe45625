"""The decode step's machinery: the view of the model it runs, the kernel policy, and the
runner that replays it as a CUDA graph (its eager kernels, or kernels fused by ``torch.compile``).

A step reads and writes only tensors (a static :class:`~mhe.attention.kv_cache.KVCache`, the
token state of :mod:`mhe.models.token_step`, a mask built from the cache's write position), so
the same graph serves every token. :class:`StepRunner` runs it in one of the
:data:`STEP_MODES`: ``eager``; ``graph``, captured once with ``torch.cuda.graph`` and replayed
(the same kernels as eager, so the output is bit-identical); ``compile``, compiled once by
``torch.compile`` (inductor fuses the elementwise work: norm with residual, bias with
activation, the cache writes) and, on CUDA, captured in the same kind of graph, so a replay
launches the fused kernels with no host work. ``auto`` is :data:`CUDA_STEP_MODE` on CUDA and
``eager`` elsewhere.

:func:`inference_view` is what generation and beam search run: the model with every fast MHE
sublayer folded into the multi-query sublayer it equals at inference (paper-notes;
``attention/folding.py``), sharing every other weight, so MHE decodes exactly like MQA with no
per-step folding work, and with the decode kernel of :func:`decode_kernel`, the one kernel
policy, set on it (:func:`mhe.attention.set_kernel`).
"""

from __future__ import annotations

import copy
import types
import warnings
from typing import Callable, Sequence

import torch
from torch import nn

from mhe.attention import triton_decode
from mhe.attention.base import Attention, set_kernel
from mhe.attention.folding import fold_model
from mhe.attention.mhe import _MHEBase
from mhe.errors import MheError, one_of

STEP_MODES = ("auto", "eager", "graph", "compile")

CUDA_STEP_MODE = "compile"
"""The step mode ``auto`` means on CUDA for generation (``model.generate``, the sampling path,
``mhe generate``, the Hugging Face adapter's ``generate``): ``compile``, the step compiled by
inductor and replayed as one CUDA graph with the choice of the next token, over ``graph`` (the
same step's eager kernels replayed). Both are measured side by side, per kind and size, by
``benchmarks/decode_speed.py`` (docs/benchmarks.md section 5: milliseconds per token and the
first call's compile time of each mode), which this choice follows. Beam search keeps ``graph``
(:data:`mhe.models.beam_search.CUDA_BEAM_MODE`): its fp32 output must equal the eager search's,
which inductor's reordered arithmetic does not promise."""


def resolve_mode(mode: str, device: torch.device, cuda_default: str = CUDA_STEP_MODE) -> str:
    """The mode a step runs in on ``device``: ``auto`` is ``cuda_default`` on CUDA, ``eager``
    elsewhere; ``graph`` needs CUDA (elsewhere it is ``eager``)."""
    if mode not in STEP_MODES:
        raise one_of("decode step mode", mode, STEP_MODES)
    if mode == "auto":
        return cuda_default if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        return "eager"  # CUDA graphs need a CUDA device
    return mode


def weights_version(model: nn.Module) -> tuple:
    """Changes whenever a parameter is modified in place (an optimiser step, a load) or replaced
    (``model.to(...)``)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def decode_kernel(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None,
                  requested: str | None = None, *, batch: int | None = None, positions: int | None = None) -> str:
    """The kernel ``module``'s attention sublayers decode one-token steps with: the generation
    policy, for ``generate`` and beam search alike.

    ``requested`` when given (the caller chose). Else, on CUDA, for sublayers configured with the
    default ``sdpa``: ``eager-one-token`` in fp32 (SDPA has no fast fp32 one-query kernel,
    docs/benchmarks.md section 6); where every cache holds one K/V head (MQA, SHA, fast MHE),
    ``sdpa-expand`` for one row of at most :data:`EXPAND_MAX_POSITIONS` cache ``positions`` on a
    card with SDPA's cuDNN kernel (the head expanded without a copy: one cuDNN kernel a layer, as
    MHA gets, where FlashAttention's split-K step launches two; docs/benchmarks.md section 9) and
    ``flash-decode`` otherwise (split-K FlashAttention over the keys, ``attention/flash_decode.py``).
    With Triton installed, every cache with fewer K/V heads than query heads (MQA, SHA, fast MHE,
    GQA) decodes with ``split-k-decode`` (``attention/triton_decode.py``: a group's query heads in
    one tile, the keys split across the card), in fp32 too, except one short row in bf16/fp16 on such
    a card, which keeps one kernel a layer (``sdpa-expand``, or ``sdpa`` for a grouped cache).
    Else the configured kernel, which a model configured with another kernel keeps. ``dtype``:
    the decoding dtype (default: the weights').
    """
    if requested is not None:
        return requested
    attns = _attention(module)
    configured = attns[0].cfg.kernel if attns else "sdpa"
    if torch.device(device).type != "cuda" or any(a.cfg.kernel != "sdpa" for a in attns):
        return configured
    fp32 = (dtype or next(module.parameters()).dtype) == torch.float32
    one_short_row = batch == 1 and positions is not None and positions <= EXPAND_MAX_POSITIONS
    cached = [a for a in attns if a.supports_cache]
    one_head = all(a.cache_heads == 1 for a in cached)
    if triton_decode.available() and cached and all(a.cache_heads < a.cfg.n_heads or a.cache_heads == 1
                                                    for a in cached):
        if one_short_row and not fp32 and _cudnn_attention(device):  # one kernel a layer, not split-K's two
            return "sdpa-expand" if one_head else configured
        return "split-k-decode"
    if fp32:
        return "eager-one-token"
    if one_head:
        return "sdpa-expand" if one_short_row and _cudnn_attention(device) else "flash-decode"
    return configured


EXPAND_MAX_POSITIONS = 1024
"""The longest cache a one-row decode of a one-K/V-head model reads through ``sdpa-expand`` (the
measured case: 768 positions on an H100, 0.562 against 0.604 ms a token for MHE-Mul; longer
caches keep the split over keys, which spreads one row's work over the card)."""


def _cudnn_attention(device: torch.device | str) -> bool:
    """SDPA's cuDNN kernel is on and the card is a Hopper or later (sm90, where ``sdpa-expand``
    was measured to take it)."""
    return torch.backends.cuda.cudnn_sdp_enabled() and torch.cuda.get_device_capability(torch.device(device)) >= (9, 0)


def split_kernel(kernel: str) -> tuple[str, str | None]:
    """A kernel option that may be ``auto`` (``mhe bench --kernel``) -> (the model's configured
    kernel, the decode kernel asked for; None = the automatic choice of :func:`decode_kernel`)."""
    return ("sdpa", None) if kernel == "auto" else (kernel, kernel)


def inference_view(model: nn.Module, kernel: str | None = None,
                   scope: Callable[[nn.Module], nn.Module] | None = None) -> nn.Module:
    """``model`` with foldable MHE sublayers folded to MQA (fast MHE under rotary positions runs as it
    is, with its one-head cache) and, with ``kernel``, the attention
    sublayers of ``scope(view)`` (default: all) set to it; shares all parameters and buffers with
    ``model``, which is left unchanged (``model`` itself when nothing changes). Computes the same
    function as ``model`` (the folded sublayers by the identities above)."""
    part = scope or (lambda m: m)
    fold = any(isinstance(m, _MHEBase) and m.foldable for m in model.modules())
    if not fold and (kernel is None or all(a.cfg.kernel == kernel for a in _attention(part(model)))):
        return model
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    view = copy.deepcopy(model, memo)
    if fold:
        view = fold_model(view).eval()
    if kernel is not None:
        set_kernel(part(view), kernel)
    return view


def view_kernels(view: nn.Module) -> str:
    """The kernels a view's attention sublayers run, e.g. ``flash-decode`` (for reports)."""
    return ",".join(sorted({a.cfg.kernel for a in _attention(view)})) or "-"


def _attention(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


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
        default_rng = torch.cuda.get_rng_state()
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # the first run compiles (compile mode) and plans kernels
                self._before()
                self.step(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self._before()
        for g, state in rng:
            g.set_state(state)
        torch.cuda.set_rng_state(default_rng)
        graph = torch.cuda.CUDAGraph()
        if self.generators and not hasattr(graph, "register_generator_state"):
            raise MheError("sampling with a seed inside a captured step needs torch >= 2.5; use step_mode='eager'")
        for g in self.generators:
            graph.register_generator_state(g)
        with torch.cuda.graph(graph):
            self._out = self.step(*self.inputs)
        for dst, src in zip(self.inputs, saved):
            dst.copy_(src)
        self._graph = graph


def compile_step(step: Callable[..., torch.Tensor], *, device: torch.device,
                 options: dict | None = None) -> Callable[..., torch.Tensor]:
    """``step`` compiled once by ``torch.compile`` (``fullgraph``, static shapes; ``options``
    added), to be captured in the runner's own CUDA graph (so not in inductor's: no
    ``reduce-overhead`` here).

    Each call compiles its own copy of ``step``'s code object, so dynamo's cache of compiled
    graphs (and its limit of 8 per code object) belongs to this step and goes with it: a process
    that decodes with many models or shapes never falls back to eager. If compilation fails
    (no working compiler, an operator inductor cannot lower), one warning says so and the step
    runs its eager kernels, as the trainer does (``mhe.training.step``)."""
    opts = dict(options or {})
    if device.type == "cuda" and opts.get("mode") in ("reduce-overhead", "max-autotune"):
        raise MheError(f"compile_options mode {opts['mode']!r} captures CUDA graphs of its own; the decode step "
                       "is captured as one graph already: use 'default' or 'max-autotune-no-cudagraphs'")
    own = step
    if isinstance(step, types.FunctionType):
        own = types.FunctionType(step.__code__.replace(), step.__globals__, step.__name__, step.__defaults__,
                                 step.__closure__)
    return _CompiledStep(torch.compile(own, fullgraph=True, dynamic=False, **opts), step)


class _CompiledStep:
    """The compiled step, or, once its compilation failed, the eager one (see :func:`compile_step`)."""

    def __init__(self, compiled: Callable[..., torch.Tensor], eager: Callable[..., torch.Tensor]) -> None:
        self.run, self.eager, self.proven = compiled, eager, False

    def __call__(self, *args):
        if self.proven:
            return self.run(*args)
        try:
            out = self.run(*args)
        except MheError:
            raise
        except Exception as e:  # noqa: BLE001  dynamo, inductor or a missing compiler
            first = (str(e).strip().splitlines() or [""])[0][:160]
            warnings.warn(f"torch.compile cannot compile this decode step ({type(e).__name__}: {first}); "
                          "it runs its eager kernels", RuntimeWarning, stacklevel=2)
            self.run = self.eager
            out = self.run(*args)
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


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that shares every parameter and buffer with it (a view that
    holds no reference to ``model`` itself)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)
