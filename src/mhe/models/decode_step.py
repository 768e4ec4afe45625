"""One decode step, run eagerly, replayed as a CUDA graph, or compiled once.

A step reads and writes only tensors (a static :class:`~mhe.attention.kv_cache.KVCache`, a token
tensor), so the same graph serves every token. :class:`StepRunner` owns the step's input and
output tensors: ``graph`` captures the step once with ``torch.cuda.graph`` and replays it (the
same kernels as eager, so the output is bit-identical); ``compile`` wraps it in
``torch.compile`` (``mode="reduce-overhead"`` on CUDA), compiled once for every token. ``auto``
is ``graph`` on CUDA and ``eager`` elsewhere.

:func:`inference_view` is what generation runs: the model with every fast MHE sublayer folded
into the multi-query sublayer it equals at inference (paper-notes; ``attention/folding.py``),
sharing every other weight, so MHE decodes exactly like MQA with no per-step folding work.
It also picks each sublayer's decode kernel (:func:`decode_kernel`): on a GPU a sublayer whose
cache holds one K/V head (MQA, SHA, folded MHE) and runs the default ``sdpa`` kernel decodes
with ``flash-decode`` (split-K FlashAttention, ``attention/flash_decode.py``) unless the
caller names a kernel.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Callable, Sequence

import torch
from torch import nn

from mhe.attention import kernels
from mhe.attention.base import Attention
from mhe.attention.folding import fold_model
from mhe.attention.mhe import _MHEBase
from mhe.errors import one_of

STEP_MODES = ("auto", "eager", "graph", "compile")


def resolve_mode(mode: str, device: torch.device) -> str:
    if mode not in STEP_MODES:
        raise one_of("decode step mode", mode, STEP_MODES)
    if mode == "auto":
        return "graph" if device.type == "cuda" else "eager"
    if mode == "graph" and device.type != "cuda":
        return "eager"  # CUDA graphs need a CUDA device
    return mode


def weights_version(model: nn.Module) -> tuple:
    """Changes whenever a parameter is modified in place (an optimiser step, a load)."""
    return tuple(p._version for p in model.parameters())


def decode_kernel(attn: Attention, device: torch.device, requested: str | None = None) -> str:
    """The kernel one attention sublayer decodes with.

    ``requested`` when given (the caller chose); else ``flash-decode`` on CUDA for a sublayer
    whose cache holds one K/V head and whose configured kernel is the default ``sdpa``; else
    the sublayer's own kernel (a kernel the model was configured with is kept).
    """
    if requested is not None:
        return requested
    if device.type == "cuda" and attn.cfg.kernel == "sdpa" and attn.supports_cache and attn.cache_heads == 1:
        return "flash-decode"
    return attn.cfg.kernel


def split_kernel(kernel: str) -> tuple[str, str | None]:
    """A kernel option that may be ``auto`` (``mhe bench --kernel``) -> (the model's configured
    kernel, the decode kernel asked for; None = the automatic choice of :func:`decode_kernel`)."""
    return ("sdpa", None) if kernel == "auto" else (kernel, kernel)


def inference_view(model: nn.Module, kernel_of: Callable[[Attention], str] | None = None) -> nn.Module:
    """``model`` with fast MHE sublayers folded to MQA and, with ``kernel_of``, each attention
    sublayer set to the kernel ``kernel_of(sublayer)`` names (e.g. ``lambda a: decode_kernel(a,
    device)``); shares all parameters and buffers with ``model``, which is left unchanged.
    Computes the same function as ``model`` (the folded sublayers by the identities above)."""
    fold = any(isinstance(m, _MHEBase) and not m.reference for m in model.modules())
    if not fold and (kernel_of is None or all(kernel_of(a) == a.cfg.kernel for a in _attention(model))):
        return model
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    view = copy.deepcopy(model, memo)
    if fold:
        view = fold_model(view).eval()
    for attn in _attention(view) if kernel_of is not None else ():
        kernel = kernel_of(attn)
        if kernel != attn.cfg.kernel:
            attn.cfg = dataclasses.replace(attn.cfg, kernel=kernels.check_kernel(kernel))
    return view


def view_kernels(view: nn.Module) -> str:
    """The kernels a view's attention sublayers run, e.g. ``flash-decode`` (for reports)."""
    return ",".join(sorted({a.cfg.kernel for a in _attention(view)})) or "-"


def _attention(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


class StepRunner:
    """Calls ``step(*inputs) -> tensor`` through fixed input/output tensors.

    Args:
        step: the decode step; it may mutate caches in place.
        inputs: example inputs (copied into the runner's own tensors on each call).
        mode: ``eager``, ``graph`` or ``compile`` (see the module docstring).
        compile_options: passed to ``torch.compile`` in ``compile`` mode.
        before_warmup: called before each warm-up run of ``graph`` mode, to undo what a
            previous run changed (the caches' write position); the step's effects on the
            caches are the same on replay, so a warm-up is harmless once undone.
    """

    def __init__(self, step: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], *, mode: str,
                 before_warmup: Callable[[], None] | None = None, compile_options: dict | None = None,
                 device: torch.device | None = None) -> None:
        self.mode = mode
        device = device if device is not None else inputs[0].device
        self.inputs = [t.clone() for t in inputs]
        self._step = step
        self._graph = None
        self._out: torch.Tensor | None = None
        self._before = before_warmup or (lambda: None)
        if mode == "compile":
            opts = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
            opts.update(compile_options or {})
            self._step = torch.compile(step, fullgraph=True, dynamic=False, **opts)

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for dst, src in zip(self.inputs, inputs):
            dst.copy_(src)
        if self.mode != "graph":
            return self._step(*self.inputs)
        if self._graph is None:
            self._capture()
        self._graph.replay()
        return self._out

    def _capture(self) -> None:
        saved = [t.clone() for t in self.inputs]
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._before()
                self._step(*self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self._before()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._out = self._step(*self.inputs)
        for dst, src in zip(self.inputs, saved):
            dst.copy_(src)
        self._graph = graph


def cache_positions(caches) -> list[torch.Tensor]:
    """The write positions of a flat or paired list of caches (to restore after a warm-up)."""
    flat = [c for pair in caches for c in (pair if isinstance(pair, tuple) else (pair,))]
    return [c.index for c in flat]


def restorer(caches) -> Callable[[], None]:
    """A function that puts every cache's write position back where it is now."""
    idx = cache_positions(caches)
    saved = [i.clone() for i in idx]

    def restore() -> None:
        for i, s in zip(idx, saved):
            i.copy_(s)
    return restore
