"""The decode step's machinery: the view of the model it runs, the kernel policy, and the
runner that replays it as a CUDA graph or compiles it once.

A step reads and writes only tensors (a static :class:`~mhe.attention.kv_cache.KVCache`, a token
tensor, a mask built from the cache's write position), so the same graph serves every token.
:class:`StepRunner` owns the step's input and output tensors: ``graph`` captures the step once
with ``torch.cuda.graph`` and replays it (the same kernels as eager, so the output is
bit-identical); ``compile`` wraps it in ``torch.compile`` (``mode="reduce-overhead"`` on CUDA),
compiled once for every token. ``auto`` is ``graph`` on CUDA and ``eager`` elsewhere.

:func:`inference_view` is what generation and beam search run: the model with every fast MHE
sublayer folded into the multi-query sublayer it equals at inference (paper-notes;
``attention/folding.py``), sharing every other weight, so MHE decodes exactly like MQA with no
per-step folding work, and with the decode kernel of :func:`decode_kernel`, the one kernel
policy, set on it (:func:`mhe.attention.set_kernel`).
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from mhe.attention.base import Attention, set_kernel
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
    """Changes whenever a parameter is modified in place (an optimiser step, a load) or replaced
    (``model.to(...)``)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())


def decode_kernel(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None,
                  requested: str | None = None) -> str:
    """The kernel ``module``'s attention sublayers decode one-token steps with: the generation
    policy, for ``generate`` and beam search alike.

    ``requested`` when given (the caller chose). Else, on CUDA, for sublayers configured with the
    default ``sdpa``: ``eager-one-token`` in fp32 (SDPA has no fast fp32 one-query kernel,
    docs/benchmarks.md section 6); ``flash-decode`` where every cache holds one K/V head (MQA,
    SHA, fast MHE: split-K FlashAttention, ``attention/flash_decode.py``). Else the configured
    kernel, which a model configured with another kernel keeps. ``dtype``: the decoding dtype
    (default: the weights').
    """
    if requested is not None:
        return requested
    attns = _attention(module)
    configured = attns[0].cfg.kernel if attns else "sdpa"
    if torch.device(device).type != "cuda" or any(a.cfg.kernel != "sdpa" for a in attns):
        return configured
    if (dtype or next(module.parameters()).dtype) == torch.float32:
        return "eager-one-token"
    if all(a.cache_heads == 1 for a in attns if a.supports_cache):
        return "flash-decode"
    return configured


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


def restorer(caches: Sequence) -> Callable[[], None]:
    """A function that puts every cache's write position back where it is now (after a warm-up
    run of a step that advanced them)."""
    idx = [c.index for c in caches]
    saved = [i.clone() for i in idx]

    def restore() -> None:
        for i, s in zip(idx, saved):
            i.copy_(s)
    return restore
