"""The decoding state that outlives one ``generate`` call: :class:`Generator`.

A caller holds one (``model.generator(batch, max_len)``, then ``model.generate(...,
session=gen)``); without one, ``generate`` uses the model's default session
(:func:`default_session`). A session holds the inference view of the model (fast MHE folded to
MQA, the decode kernel of :func:`~mhe.models.decode_step.decode_kernel` set), the static KV
caches, the :class:`~mhe.models.token_step.TokenState`, and per choice rule one captured region
(:class:`~mhe.models.decode_step.StepRunner`): the model's step (eager, or compiled once) then
the choice of the next token and the stop bookkeeping, so one replay produces one token.
"""

from __future__ import annotations

import weakref
from typing import Sequence

import torch

from mhe.attention import kernels, masks
from mhe.attention.fused_projections import fuse_projections
from mhe.errors import MheError, require_positive
from mhe.models.decode_step import (
    StepRunner,
    compile_step,
    decode_kernel,
    inference_view,
    resolve_mode,
    restorer,
    shared_copy,
    weights_version,
)
from mhe.models.sampling import SamplingConfig
from mhe.models.token_step import Rule, TokenState

REGIONS = 8  # captured regions (choice rules) a session keeps, the newest
DEFAULT_SESSIONS = 2  # default sessions kept per model, the newest
SESSION_ROUND = 64  # a default session's length is the request's, rounded up to a multiple of this


class Generator:
    """The decoding state one caller reuses across ``generate`` calls of ``batch`` prompts and
    up to ``max_len`` positions (prompt + new tokens). The view and steps are rebuilt when the
    model's weights change. It refers to the model weakly (the view shares its weights), so a
    session kept for a model never keeps the model alive.

    Args:
        step_mode: ``auto`` (:data:`~mhe.models.decode_step.CUDA_STEP_MODE` on a GPU, eager on a
            CPU), ``eager``, ``graph``, ``compile``; ``compile_options`` go to ``torch.compile``.
        kernel: the attention kernel of every sublayer while decoding (:data:`KERNELS
            <mhe.attention.kernels.KERNELS>`); None: :func:`~mhe.models.decode_step.decode_kernel`'s
            choice, except for prompts whose mask is not left padding (a gap inside a row),
            which keep the configured kernels.
    """

    def __init__(self, model, batch: int, max_len: int, *, step_mode: str = "auto", kernel: str | None = None,
                 compile_options: dict | None = None) -> None:
        require_positive(batch=batch, max_len=max_len)
        p = next(model.parameters())
        self._model = weakref.ref(model)
        self.batch, self.max_len = batch, max_len
        self.dtype, self.device = p.dtype, p.device  # of the weights, and so of the caches
        self.mode = resolve_mode(step_mode, self.device)
        self.kernel = kernels.check_kernel(kernel) if kernel is not None else None
        self.compile_options = compile_options
        self.options = {"step_mode": self.mode, "kernel": self.kernel, "compile_options": compile_options}
        self.view, self.caches, self.padded = None, None, False
        self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=self.device)  # [B, L] over the caches
        self.state = TokenState(batch, max_len, self.device)
        self.rng: torch.Generator | None = None  # a seeded call's private generator, made once
        self._built_for, self._steps, self._regions = None, {}, {}

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise MheError("the model of this generator no longer exists")
        return model

    def prefill(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor,
                new_tokens: int) -> torch.Tensor:
        """Run the prompts ``[B, P]`` into empty caches, to be followed by up to ``new_tokens``
        tokens; the logits ``[B, V]`` of the next token."""
        b, p = input_ids.shape
        if b != self.batch or p + new_tokens > self.max_len:
            raise MheError(f"this generator holds {self.batch} rows of {self.max_len} positions; got {b} prompts "
                           f"of {p} tokens + {new_tokens} new (build one with model.generator(batch, max_len))")
        self.padded = not bool(prompt_mask.all())
        policy = decode_kernel(self.model, self.device, self.dtype, batch=b, positions=self.max_len)
        self._build(self.kernel or (policy if not self.padded or _left_padded(prompt_mask) else None))
        for c in self.caches:
            c.reset()
        self.key_mask.fill_(True)
        self.key_mask[:, :p] = prompt_mask
        mask = masks.self_attention_mask(input_ids, self.key_mask if self.padded else None, keys=self.max_len)
        return self.view(input_ids, attention_mask=mask, caches=self.caches, position_ids=positions,
                         last_only=True).logits[:, -1]

    def rule(self, sampling: SamplingConfig, stop_ids: Sequence[int], min_new_tokens: int) -> Rule:
        """The rule of a call (its private generator seeded now)."""
        generator = None
        if sampling.do_sample and sampling.seed is not None:
            if self.rng is None:
                self.rng = torch.Generator(device=self.device)
            generator = self.rng.manual_seed(sampling.seed)
        stop_ids = tuple(int(t) for t in stop_ids)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=self.device) if stop_ids else None
        return Rule(sampling, stop_ids, stops, bool(min_new_tokens and stops is not None), generator)

    def step(self, rule: Rule) -> torch.Tensor:
        """One token: the model's step on the newest tokens, then ``rule``'s choice; the logits
        ``[B, V]`` it chose from (the region's output tensor, reused by the next step)."""
        key = (self.padded, rule.key)
        run = self._regions.pop(key, None)  # re-inserted: the newest last
        if run is None:
            if len(self._regions) >= REGIONS:
                self._regions.pop(next(iter(self._regions)))
            model_step, state = self._model_step(), self.state

            def region():
                logits = model_step()
                state.choose(logits, rule)
                return logits
            watched = self.state.tensors() + [c.index for c in self.caches]
            run = StepRunner(region, mode="eager" if self.mode == "eager" else "graph", device=self.device,
                             before_warmup=restorer(watched), generators=[rule.generator] if rule.generator else [])
        self._regions[key] = run
        return run()

    def _model_step(self):
        """The logits ``[B, V]`` of the state's newest tokens (compiled once in ``compile`` mode)."""
        if self.padded not in self._steps:
            view, caches, state = self.view, self.caches, self.state
            key_mask = self.key_mask if self.padded else None

            def model_step():
                return view(state.tok, attention_mask=key_mask, caches=caches, position_ids=state.pos).logits[:, -1]
            self._steps[self.padded] = model_step if self.mode != "compile" else compile_step(
                model_step, device=self.device, options=self.compile_options)
        return self._steps[self.padded]

    def _build(self, kernel: str | None) -> None:
        """The view for ``kernel`` (None: the configured ones) and these weights; a new one drops
        the steps built on the old."""
        model = self.model
        p = next(model.parameters())
        if (p.dtype, p.device) != (self.dtype, self.device):
            raise MheError(f"this generator was built for {self.dtype} on {self.device}, the model is now "
                           f"{p.dtype} on {p.device}; build a new one with model.generator(batch, max_len)")
        key = (weights_version(model), kernel, model.training)
        if key != self._built_for:
            view = inference_view(model, kernel)
            view = shared_copy(model) if view is model else view  # never the model itself (weak reference)
            self.view = fuse_projections(view)  # one product for Q, K, V: two kernels fewer a layer
            self._steps, self._regions, self._built_for = {}, {}, key
            if self.caches is None:
                self.caches = self.view.new_caches(self.batch, self.max_len, dtype=self.dtype, device=self.device)


def _left_padded(prompt_mask: torch.Tensor) -> bool:
    """Every row is padding, then real tokens (reads the device)."""
    return bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all())


# --- default sessions: what generate uses when the caller holds none --------------------------------
_DEFAULT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> [Generator], newest last


def default_session(model, batch: int, needed: int, **options) -> Generator:
    """The model's default session for ``batch`` prompts of ``needed`` positions (prompt + new
    tokens) with ``options`` (``step_mode``, ``kernel``, ``compile_options``): one it already
    has that fits (at most twice as long as needed, or one rounding step), else a new one whose
    length is ``needed`` rounded up to a multiple of :data:`SESSION_ROUND` (at most the model's
    ``max_len`` when that bounds it). The :data:`DEFAULT_SESSIONS` newest are kept, outside the
    model (a weak registry: they go with the model; :func:`release_default_sessions` frees them
    sooner), so repeated calls reuse their caches and captured steps."""
    p = next(model.parameters())
    held = _DEFAULT.setdefault(model, [])
    resolved = _resolved(options, p.device)
    length = -(-needed // SESSION_ROUND) * SESSION_ROUND
    for i, gen in enumerate(reversed(held)):
        if (gen.options == resolved and gen.batch == batch and needed <= gen.max_len <= max(2 * needed, length)
                and (gen.dtype, gen.device) == (p.dtype, p.device)):
            held.append(held.pop(len(held) - 1 - i))  # the newest last
            return gen
    if model.cfg.positions != "sinusoidal":  # a table of max_len positions bounds the length
        length = max(needed, min(length, model.cfg.max_len))
    held.append(Generator(model, batch, length, **options))
    del held[:-DEFAULT_SESSIONS]
    return held[-1]


def _resolved(options: dict, device: torch.device) -> dict:
    """``options`` as a session built with them on ``device`` records them (:attr:`Generator.options`)."""
    kernel = options.get("kernel")
    return {"step_mode": resolve_mode(options.get("step_mode", "auto"), device),
            "kernel": kernels.check_kernel(kernel) if kernel is not None else None,
            "compile_options": options.get("compile_options")}


def release_default_sessions(model) -> None:
    """Free the default sessions of ``model`` (their caches and captured steps) now."""
    _DEFAULT.pop(model, None)
