"""Generation for the decoder: the loop, the session it runs in, and the choice of each token.

:func:`generate` is the loop. It runs the prompt once (SDPA, plain causal when nothing is
padded) into the static caches of a :class:`Generator` session, chooses the first token, then
replays one region per token: the model's decode step, the choice of the next token (greedy, or
:class:`SamplingConfig`'s sampling) and the stop bookkeeping, all on the device
(:class:`TokenState`), as one CUDA graph on a GPU (eager kernels, or compiled ones:
:data:`~mhe.models.captured_step.CUDA_STEP_MODE`). The host reads the device only to learn,
every :data:`CHECK_EVERY` tokens, whether every row has stopped (every token with a streamer).

A :class:`Generator` is the decoding state that outlives one call. A caller holds one
(``model.generator(batch, max_len)``, then ``model.generate(..., session=gen)``); without one,
``generate`` reuses the model's default session (:func:`default_session`). A session holds the
inference view of the model (:func:`~mhe.attention.folding.inference_view`: fast MHE folded to
MQA, the decode kernel of :func:`~mhe.attention.kernels.decode_kernel` set), the static KV
caches, the :class:`TokenState`, and per choice rule one captured region
(:class:`~mhe.models.captured_step.StepRunner`), so one replay produces one token.

:class:`TokenState` holds the newest token of each row and its position (the next step's
inputs), how many new tokens there are, which rows have stopped and after how many tokens, and
the new tokens themselves. :meth:`TokenState.choose` applies a :class:`Rule` (greedy or
sampling, the stop tokens, whether ``min_new_tokens`` holds them back) to one step's logits;
the same code runs eagerly after the prompt and inside every replay, so eager and captured
generation choose alike. The sampling functions read and write tensors only (no host reads);
the order of the filters and the draw are transformers' (temperature, then top-k, then top-p on
float32 logits, then one multinomial draw per row), so a seeded draw gives transformers' tokens.

Batches of prompts of different lengths are LEFT padded (``attention_mask`` 0 on the
left): positions count from each row's first real token and padding is never attended to,
so a row's continuation is the one it gets alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from mhe.attention import kernels, masks
from mhe.attention.folding import inference_view, shared_copy, weights_version
from mhe.attention.fused_projections import fuse_projections
from mhe.errors import MheError, checked_keywords, require_positive
from mhe.models.captured_step import (StepRunner, check_compile_options, compile_step, default_compile_options,
                                      resolve_mode, restorer)
from mhe.models.outputs import as_bool_mask

__all__ = ["CHECK_EVERY", "GenerateOutput", "Generator", "Rule", "SamplingConfig", "TokenState", "default_session",
           "draw", "filter_logits", "generate", "left_pad", "next_token", "release_default_sessions"]

CHECK_EVERY = 8  # tokens between the host's reads of whether every row has stopped
REGIONS = 8  # captured regions (choice rules) a session keeps, the newest
DEFAULT_SESSIONS = 2  # default sessions kept per model, the newest
SESSION_ROUND = 64  # a default session's length is the request's, rounded up to a multiple of this


@dataclass
class GenerateOutput:
    """What :func:`generate` returns with ``return_dict=True``.

    Attributes:
        tokens: ``[B, P + n]``, the prompts followed by ``n <= max_new_tokens`` new tokens.
        stopped: ``[B]`` bool: the row ended on a stop token (else it ran to ``max_new_tokens``).
        new_tokens: ``[B]``: tokens the row generated, its stop token included.
        logits: ``[B, n, V]``, the logits each new token was chosen from (``return_logits``).
    """

    tokens: torch.Tensor
    stopped: torch.Tensor
    new_tokens: torch.Tensor
    logits: torch.Tensor | None = None

    def finish_reasons(self) -> list[str]:
        """Why each row ended: ``"stop"`` (a stop token) or ``"length"`` (``max_new_tokens``)."""
        return ["stop" if s else "length" for s in self.stopped.tolist()]


@checked_keywords
@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, attention_mask: torch.Tensor | None = None,
             stop_ids: Sequence[int] = (), pad_id: int | None = None, min_new_tokens: int = 0,
             do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, streamer: Callable[[list[int]], None] | None = None,
             session: Generator | None = None, step_mode: str = "auto", compile_options: dict | None = None,
             kernel: str | None = None, return_logits: bool = False, return_dict: bool = False):
    """Continue each prompt by up to ``max_new_tokens`` tokens.

    Args:
        model: a :class:`~mhe.models.decoder.DecoderForCausalLM`.
        input_ids: prompts ``[B, P]``, left-padded when their lengths differ.
        attention_mask: ``[B, P]``, 1 for real tokens (0 for the left padding).
        stop_ids: tokens that end a row; the row then holds ``pad_id`` (default: the first
            stop token), and generation ends when every row has stopped.
        min_new_tokens: stop tokens cannot be chosen before a row has this many new tokens
            (as transformers' ``min_new_tokens``).
        do_sample, temperature, top_k, top_p, seed: see :class:`SamplingConfig`.
        streamer: called after every step with the new token of each row.
        session: a :class:`Generator` to reuse (its caches and captured steps, with its own
            settings); None: the model's default session for this size and ``step_mode``,
            ``compile_options`` and ``kernel`` (:func:`default_session`).
        return_logits: also return the logits each new token was chosen from, ``[B, n, V]``.
        return_dict: return a :class:`GenerateOutput` (with why each row stopped).

    Returns:
        ``[B, P + n]`` token ids, the prompts followed by ``n <= max_new_tokens`` new tokens (with
        ``return_logits``, a pair with the logits), or a :class:`GenerateOutput`.
    """
    sampling = SamplingConfig(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    prompt_mask, positions = _prompt(model, input_ids, attention_mask, max_new_tokens, min_new_tokens)
    session = _session(model, input_ids, max_new_tokens, session, step_mode=step_mode, kernel=kernel,
                       compile_options=compile_options)
    logits = session.prefill(input_ids, prompt_mask, positions, max_new_tokens)
    fill = pad_id if pad_id is not None else (int(stop_ids[0]) if len(stop_ids) else 0)
    rule = session.rule(sampling, stop_ids, min_new_tokens)
    state = session.state
    state.start(positions[:, -1:], min_new_tokens=min_new_tokens, fill=fill)
    seen = []
    for i in range(max_new_tokens):
        if i == 0:
            state.choose(logits, rule)  # the prompt's logits: eagerly, by the region's own code
        else:
            logits = session.step(rule)
        if return_logits:
            seen.append(logits.clone())  # the step's output tensor is reused by the next step
        if streamer is not None:
            streamer(state.tok[:, 0].tolist())
        if rule.stops is not None and (i % CHECK_EVERY == CHECK_EVERY - 1 or streamer is not None) \
                and bool(state.done.all()):
            break
    state.check_finite()
    made = state.new_tokens(max_new_tokens)  # [B]
    width = int(made.max()) if rule.stops is not None else max_new_tokens  # up to the last row's stop, as transformers
    result = GenerateOutput(torch.cat([input_ids, state.out[:, :width]], 1), state.done.clone(), made,
                            torch.stack(seen[:width], 1) if return_logits else None)
    if return_dict:
        return result
    return (result.tokens, result.logits) if return_logits else result.tokens


def _prompt(model, input_ids, attention_mask, max_new_tokens: int, min_new_tokens: int):
    """The prompts' boolean mask ``[B, P]`` and positions ``[B, P]`` (counted from each row's first
    real token), after checking the request."""
    require_positive(max_new_tokens=max_new_tokens)
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise MheError(f"min_new_tokens must be a non-negative integer, got {min_new_tokens!r}")
    _check_prompts(input_ids, attention_mask)
    b, p = input_ids.shape
    total = p + max_new_tokens
    if total > model.cfg.max_len and model.cfg.positions in ("learned", "rotary"):  # tables of max_len positions
        raise MheError(f"prompt {p} + max_new_tokens {max_new_tokens} = {total} exceeds the model's "
                       f"max_len {model.cfg.max_len}")
    prompt_mask = torch.ones(b, p, dtype=torch.bool, device=input_ids.device) if attention_mask is None \
        else as_bool_mask(attention_mask).to(input_ids.device)
    if bool((~prompt_mask[:, -1]).any()):
        raise MheError("prompts must be left-padded: the last position of every row must be a real token")
    return prompt_mask, (prompt_mask.long().cumsum(1) - 1).clamp_min(0)


def _check_prompts(input_ids, attention_mask) -> None:
    """Prompts ``[B, P]`` of token ids with B, P >= 1, and a mask of their shape."""
    shape = tuple(getattr(input_ids, "shape", ()))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or 0 in shape \
            or input_ids.is_floating_point():
        what = f"a {input_ids.dtype} tensor of shape {shape}" if isinstance(input_ids, torch.Tensor) \
            else type(input_ids).__name__
        raise MheError(f"input_ids must be token ids [B, P] with at least one prompt of at least one token, "
                       f"got {what} (one prompt: ids[None])")
    if attention_mask is not None and tuple(getattr(attention_mask, "shape", ())) != shape:
        raise MheError(f"attention_mask must have the shape of input_ids {shape}, got "
                       f"{tuple(getattr(attention_mask, 'shape', ()))}")


def _session(model, input_ids, max_new_tokens: int, session: Generator | None, **options) -> Generator:
    """The caller's session, or the model's default one for this request (``options``: the step's
    settings)."""
    if session is None:
        return default_session(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, **options)
    if options != {"step_mode": "auto", "kernel": None, "compile_options": None}:
        raise MheError("step_mode, kernel and compile_options belong to the session: give them to "
                       "model.generator(...)")
    return session


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and mask, padded on the left (generation continues at the right edge)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


# --- the session: what outlives one call ----------------------------------------------------------
class Generator:
    """The decoding state one caller reuses across ``generate`` calls of ``batch`` prompts and
    up to ``max_len`` positions (prompt + new tokens). The view and steps are rebuilt when the
    model's weights change. It refers to the model weakly (the view shares its weights), so a
    session kept for a model never keeps the model alive.

    Args:
        step_mode: ``auto`` (:data:`~mhe.models.captured_step.CUDA_STEP_MODE` on a GPU, eager on a
            CPU), ``eager``, ``graph``, ``compile``; ``compile_options`` go to ``torch.compile``
            (None: inductor's defaults, or for a batch of one on CUDA
            :data:`~mhe.models.captured_step.ONE_ROW_COMPILE_OPTIONS`).
        kernel: the attention kernel of every sublayer while decoding (:data:`KERNELS
            <mhe.attention.kernels.KERNELS>`); None: :func:`~mhe.attention.kernels.decode_kernel`'s
            choice, except for prompts whose mask is not left padding (a gap inside a row),
            which keep the configured kernels.
    """

    @checked_keywords
    def __init__(self, model, batch: int, max_len: int, *, step_mode: str = "auto", kernel: str | None = None,
                 compile_options: dict | None = None) -> None:
        require_positive(batch=batch, max_len=max_len)
        p = next(model.parameters())
        self._model = weakref.ref(model)
        self.batch, self.max_len = batch, max_len
        self.dtype, self.device = p.dtype, p.device  # of the weights, and so of the caches
        self.mode = resolve_mode(step_mode, self.device)
        self.kernel = kernels.check_kernel(kernel) if kernel is not None else None
        self.compile_options = default_compile_options(batch, self.device, check_compile_options(compile_options))
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
        policy = kernels.decode_kernel(self.model, self.device, self.dtype, batch=b, positions=self.max_len)
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
            model_step, choose = self._model_step(), self._chooser(rule)

            def region():
                logits = model_step()
                choose(logits)
                return logits
            watched = self.state.tensors() + [c.index for c in self.caches]
            run = StepRunner(region, mode="eager" if self.mode == "eager" else "graph", device=self.device,
                             before_warmup=restorer(watched), generators=[rule.generator] if rule.generator else [])
        self._regions[key] = run
        return run()

    def _chooser(self, rule: Rule) -> Callable[[torch.Tensor], None]:
        """``rule``'s choice on one step's logits, as the region runs it: in ``compile`` mode a
        greedy rule's is compiled too, so its dozen small kernels (the argmax, the finite check,
        the stop and position bookkeeping) become a few, which is most of a batch-1 step's
        difference to the launch floor; a sampling rule's stays eager (its generator)."""
        state = self.state

        def choose(logits: torch.Tensor) -> None:
            state.choose(logits, rule)
        if self.mode != "compile" or rule.sampling.do_sample:
            return choose
        return compile_step(choose, device=self.device, options=self.compile_options)

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


# --- default sessions: what generate uses when the caller holds none ------------------------------
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


# --- the token state: the per-token bookkeeping on the device -------------------------------------
@dataclass(frozen=True)
class Rule:
    """How one call chooses its tokens; a captured region serves one rule (:attr:`key`).

    Attributes:
        sampling: greedy or sampling (its seed lives in ``generator``).
        stop_ids: the stop tokens; ``stops``: the same as a ``[S]`` long tensor on the device
            (None: no stop token).
        hold_back: stop tokens cannot be chosen before ``min_new_tokens`` (a tensor of the state).
        generator: the private generator a seeded call draws from (None: the device's default).
    """

    sampling: SamplingConfig
    stop_ids: tuple[int, ...] = ()
    stops: torch.Tensor | None = field(default=None, compare=False)
    hold_back: bool = False
    generator: torch.Generator | None = field(default=None, compare=False)

    @property
    def key(self) -> tuple:
        """What a captured region depends on (host values only: no device read per token)."""
        return (self.sampling.rule, self.stop_ids, self.hold_back, self.generator is not None)


class TokenState:
    """Static per-token tensors of ``batch`` rows generating up to ``max_len`` new tokens.

    Attributes:
        tok: ``[B, 1]`` the newest token of each row (the next step's input).
        pos: ``[B, 1]`` its position.
        count: 0-d, the new tokens so far (the column the next one is written to).
        done: ``[B]`` the row has stopped (it then holds ``fill``).
        made: ``[B]`` new tokens of a stopped row, its stop token included.
        out: ``[B, max_len]`` the new tokens.
        min_new: 0-d, ``min_new_tokens``; fill: 0-d, the token of a stopped row.
        bad: 0-d, the first new token (0-based) whose logits were not finite in a running row
            (NaN, +inf, or all -inf), -1 while none was; read once per call (:meth:`check_finite`).
    """

    def __init__(self, batch: int, max_len: int, device: torch.device) -> None:
        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)
        self.tok, self.pos, self.out = zeros(batch, 1), zeros(batch, 1), zeros(batch, max_len)
        self.count, self.min_new, self.fill = zeros(), zeros(), zeros()
        self.done, self.made = zeros(batch, dtype=torch.bool), zeros(batch)
        self.bad = zeros() - 1

    def tensors(self) -> list[torch.Tensor]:
        """What a step changes (for a capture's warm-up to undo), ``out`` aside: a warm-up's
        writes there are overwritten by the replay that follows."""
        return [self.tok, self.pos, self.count, self.done, self.made, self.bad]

    def start(self, last_position: torch.Tensor, *, min_new_tokens: int, fill: int) -> None:
        """A new call whose prompts end at ``last_position`` ``[B, 1]``."""
        self.pos.copy_(last_position)
        self.count.zero_()
        self.done.zero_()
        self.made.zero_()
        self.min_new.fill_(min_new_tokens)
        self.fill.fill_(fill)
        self.bad.fill_(-1)

    def choose(self, logits: torch.Tensor, rule: Rule) -> None:
        """Choose each row's next token from ``logits`` ``[B, V]`` by ``rule``, record it, and
        advance: the token becomes the next step's input at the next position."""
        raw = logits
        if rule.hold_back:  # transformers' min_new_tokens: stop tokens at -inf until then
            held = logits.index_fill(-1, rule.stops, float("-inf"))
            logits = torch.where(self.count < self.min_new, held, logits)
        chosen = next_token(logits, rule.sampling, rule.generator)  # [B]
        self._note_not_finite(raw, None if rule.hold_back or rule.sampling.do_sample else chosen)
        tok = torch.where(self.done, self.fill, chosen)
        if rule.stops is not None:
            self.made.copy_(torch.where(self.done, self.made, self.count + 1))
            self.done.copy_(self.done | (tok[:, None] == rule.stops).any(-1))
        self.out.index_copy_(1, self.count.view(1), tok[:, None])
        self.tok.copy_(tok[:, None])
        self.pos.add_(1)
        self.count.add_(1)

    def _note_not_finite(self, logits: torch.Tensor, argmax: torch.Tensor | None) -> None:
        """Note in ``bad`` the first step whose row maximum is not finite (NaN, +inf, or every
        logit -inf) in a running row, without reading the device. ``argmax``: the rows' argmax
        of these same logits, whose logit is then the row maximum (argmax propagates NaN), which
        saves a second pass over the vocabulary."""
        if argmax is None or torch.compiler.is_compiling():  # compiled: fused with the argmax's pass
            top = logits.amax(-1)
        else:
            top = logits.gather(-1, argmax[:, None])[:, 0]
        broken = (top.isfinite() | self.done).logical_not().any()
        self.bad.copy_(torch.where((self.bad < 0) & broken, self.count, self.bad))

    def check_finite(self) -> None:
        """Refuse the call whose logits were not finite (a token drawn or picked from NaN is noise)."""
        step = int(self.bad)
        if step >= 0:
            raise MheError(f"the logits of new token {step + 1} (generation step {step + 1}) are not finite "
                           "(NaN or inf): the model's weights or activations are; no token can be chosen")

    def new_tokens(self, limit: int) -> torch.Tensor:
        """``[B]`` new tokens per row: a stopped row's count, else ``limit``."""
        return torch.where(self.done, self.made, limit)


# --- choosing the next token: greedy or sampling --------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        do_sample: sample from the distribution (else greedy: the most likely token).
        temperature: divides the logits before sampling (> 0).
        top_k: keep only the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (nucleus sampling, Holtzman et al. 2020; 1.0 = all).
        seed: seeds a private generator, so the same call gives the same tokens (None: the
            global generator of the device, as ``torch.manual_seed`` sets it).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise MheError(f"temperature must be > 0, got {self.temperature!r}")
        if self.top_k:
            require_positive(top_k=self.top_k)
        if not 0.0 < self.top_p <= 1.0:
            raise MheError(f"top_p must be in (0, 1], got {self.top_p!r}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A new generator seeded with ``seed`` (None without a seed: the global one is used)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)

    @property
    def rule(self) -> tuple:
        """What decides the choice apart from the seed (a captured step serves one rule)."""
        return (self.do_sample, self.temperature, self.top_k, self.top_p) if self.do_sample else (False,)


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k and top-p: ``[B, V]`` fp32 logits with removed tokens at -inf."""
    logits = logits.float()
    if cfg.temperature != 1.0:
        logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:  # from the least likely up: drop tokens while their mass stays <= 1 - top_p
        sorted_logits, order = logits.sort(dim=-1)  # ascending
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - cfg.top_p
        drop[:, -1] = False  # the most likely token is always kept
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of ``probs`` ``[B, V]``, ``[B]``: what ``torch.multinomial(probs, 1)``
    draws with the same generator state (its one-sample path: the argmax of p / q with
    q ~ Exp(1), the Gumbel-max trick), in three kernels and without its host-side checks."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of every row, ``[B]``, from last-position logits ``[B, V]``."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    return draw(filter_logits(logits, cfg).softmax(-1), generator)
