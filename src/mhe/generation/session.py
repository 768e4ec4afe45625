"""A decode session and its sampling policy: ``model.generate``'s loop and the state it runs in.

A :class:`DecodeSession` is what a caller holds across decoding calls of one model: the
inference view it decodes with (:func:`~mhe.attention.folding.inference_view`: fast MHE folded
to MQA) and its decode choice (:attr:`DecodeSession.plan`, a
:class:`~mhe.attention.kernels.DecodePlan` made once by :func:`~mhe.attention.kernels.decode_plan`
and passed down every call of the view: ``view(..., plan=plan)``), rebuilt when the
model's weights change; its policy's step mode (:func:`~mhe.generation.step.resolve_mode`); and
its captured steps (one :class:`~mhe.generation.step.RunnerCache`). Its two policies are
sampling (:class:`Generator`, here: greedy or sampled tokens of a decoder-only model) and beam
search (:class:`~mhe.generation.beam.BeamSearcher`, for the encoder-decoder).

:func:`generate` is the sampling loop. It runs the prompt once (SDPA, plain causal when nothing
is padded) into the static caches of a :class:`Generator`, chooses the first token, then replays
one region per token: the model's decode step, the choice of the next token (greedy, or
:class:`~mhe.generation.sampling.SamplingConfig`'s sampling) and the stop bookkeeping, all on
the device (:class:`~mhe.generation.sampling.TokenState`), as one CUDA graph on a GPU. The host
reads the device only to learn, every :data:`CHECK_EVERY` tokens, whether every row has stopped
(every token with a streamer).

A caller holds a :class:`Generator` (``model.generator(batch, max_len)``, then
``model.generate(..., session=gen)``); without one, ``generate`` reuses the model's default
session (:func:`default_session`). Batches of prompts of different lengths are LEFT padded
(``attention_mask`` 0 on the left): positions count from each row's first real token and
padding is never attended to, so a row's continuation is the one it gets alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mhe.attention import kernels, kv_cache, masks
from mhe.attention.folding import inference_view, shared_copy, weights_version
from mhe.attention.fused_projections import fuse_projections
from mhe.attention.masks import as_bool_mask
from mhe.errors import MheError, checked_keywords, require_positive
from mhe.generation.sampling import Rule, SamplingConfig, TokenState
from mhe.generation.step import (RunnerCache, StepRunner, check_compile_options, compile_step, default_compile_options,
                                 resolve_mode, restorer)

__all__ = ["CHECK_EVERY", "DecodeSession", "GenerateOutput", "Generator", "default_session", "generate", "left_pad",
           "release_default_sessions"]

CHECK_EVERY = 8  # tokens between the host's reads of whether every row has stopped
REGIONS = 8  # captured regions (choice rules) a session keeps, the newest
DEFAULT_SESSIONS = 2  # default sessions kept per model, the newest
SESSION_ROUND = 64  # a default session's length is the request's, rounded up to a multiple of this
PREFILL_GRAPH_TOKENS = 4096
"""Prompt tokens (rows x length) up to which a session that captures its steps (``graph`` and
``compile`` modes, on CUDA) also replays its prefill as a CUDA graph, one per prompt shape,
captured at the shape's second call (a capture costs about three eager prefills, so a length seen
once runs eagerly; the :data:`PREFILL_GRAPHS` newest graphs are kept). Such a prefill is bound by
the host launching its eager kernels: llama-135m's 256-token prompt at batch 1 launches about
1,500 kernels in 3.4 ms of GPU time but took 44-57 ms eagerly, 4.1-4.4 ms replayed
(docs/benchmarks.md). Larger prefills keep their GPU busy eagerly, and a graph would hold their
activations in its own memory pool."""
PREFILL_GRAPHS = 4  # captured prefills (prompt shapes) a session keeps, the newest
PREFILL_COMPILE_TOKENS = 32768
"""Prompt tokens (rows x length) from which a ``compile`` session compiles its prefill for the
prompt's shape, at the shape's second call (``Generator._prefill_runner``). A compile costs 20-30
s and halves a long prefill on a GPU (llama-135m, 64 x 3,840: 377.7 eager against 193.3 ms;
llama-1.1b 1,252.9 against 941.2, docs/benchmarks.md), so it pays only for long prompts run
many times: under this size a prefill saves tens of milliseconds a call and runs eagerly."""
PREFILL_COMPILES = 4
"""Prefill compiles a session makes at most (one per prompt shape): a workload of many long prompt
shapes (an evaluation's batches) pays at most this many compiles, then runs its prefills eagerly."""


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
class DecodeSession:
    """What a caller holds across decoding calls of ``model``: the view it decodes with (:meth:`build`,
    made again when the weights change), the step mode of the session's ``policy``
    (:func:`~mhe.generation.step.resolve_mode`), ``compile_options`` for a compiled step, and its
    captured steps (:attr:`runners`, the :data:`REGIONS` newest by default). It refers to the model
    weakly (the view shares its weights), so a session kept for a model never keeps it alive."""

    policy = "sample"

    def __init__(self, model, *, step_mode: str = "auto", compile_options: dict | None = None,
                 keep: int = 8) -> None:
        p = next(model.parameters())
        self._model = weakref.ref(model)
        self.dtype, self.device = p.dtype, p.device  # of the weights, and so of the caches
        self.mode = resolve_mode(step_mode, self.device, self.policy)
        self.compile_options = compile_options
        self.runners = RunnerCache(keep)
        self.view, self._built_for, self._steps = None, None, {}
        self.plan: kernels.DecodePlan | None = None  # the decode choice every call of the view gets

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise MheError("the model of this session no longer exists")
        return model

    def build(self, key, make) -> bool:
        """The view ``make()`` returns, when ``key`` (the weights' version and what else the view
        depends on) changed since the last one; the steps built on the old view go. True if new."""
        if key == self._built_for:
            return False
        self.view, self._built_for, self._steps = make(), key, {}
        self.runners.clear()
        return True

    def new_runner(self, step, *, mode: str, before_warmup, generators=()) -> StepRunner:
        """A captured ``step`` on the session's device, with its compile options (``compile`` mode)."""
        return StepRunner(step, mode=mode, device=self.device, before_warmup=before_warmup,
                          compile_options=self.compile_options, generators=generators)

    def step_mode_ran(self) -> str:
        """The step mode this session's steps ran, where ``mode`` is the one asked for: a
        ``compile`` step whose compilation failed ran its eager kernels (captured on CUDA: ``graph``)."""
        compiled = [s for s in list(self._steps.values()) + [r.step for r in self.runners.runners.values()]
                    if hasattr(s, "fell_back")]
        if self.mode == "compile" and any(s.fell_back for s in compiled):
            return f"{'graph' if self.device.type == 'cuda' else 'eager'} (compile failed)"
        return self.mode


class Generator(DecodeSession):
    """The sampling policy's session: ``batch`` prompts of up to ``max_len`` positions (prompt +
    new tokens), their static caches and token state, one captured region per choice rule.

    Args:
        step_mode: ``auto`` (:data:`~mhe.generation.step.CUDA_MODES`' ``sample`` on a GPU, eager on
            a CPU), ``eager``, ``graph``, ``compile``; ``compile_options`` go to ``torch.compile``
            (None: inductor's defaults, or for a batch of one on CUDA
            :data:`~mhe.generation.step.ONE_ROW_COMPILE_OPTIONS`).
        kernel: the attention kernel of every sublayer while decoding (:data:`KERNELS
            <mhe.attention.kernels.KERNELS>`), the session's :attr:`plan`; None:
            :func:`~mhe.attention.kernels.decode_plan`'s choice, except for prompts whose mask is not
            left padding (a gap inside a row), which run without a plan (the configured kernel).
    """

    @checked_keywords
    def __init__(self, model, batch: int, max_len: int, *, step_mode: str = "auto", kernel: str | None = None,
                 compile_options: dict | None = None) -> None:
        require_positive(batch=batch, max_len=max_len)
        super().__init__(model, step_mode=step_mode, keep=REGIONS)
        self.batch, self.max_len = batch, max_len
        self.kernel = kernels.check_kernel(kernel) if kernel is not None else None
        self.compile_options = default_compile_options(batch, self.device, check_compile_options(compile_options))
        self.options = {"step_mode": self.mode, "kernel": self.kernel, "compile_options": compile_options}
        self.caches, self.padded = None, False
        self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=self.device)  # [B, L] over the caches
        self.state = TokenState(batch, max_len, self.device)
        self.rng: torch.Generator | None = None  # a seeded call's private generator, made once
        self.prefills = RunnerCache(PREFILL_GRAPHS)  # captured prefills by (rows, length, padded)
        self.compiled_prefills = RunnerCache(PREFILL_COMPILES)  # compiled ones: never pushed out by captures
        self.prefills_seen: set[tuple] = set()  # prompt shapes prefilled once (eagerly) since the last capture
        self.prefill_compiles = 0  # prefills compiled so far (at most PREFILL_COMPILES)

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor,
                new_tokens: int) -> torch.Tensor:
        """Run the prompts ``[B, P]`` into empty caches, to be followed by up to ``new_tokens``
        tokens; the logits ``[B, V]`` of the next token. Autograd is off here as in
        ``model.generate``, so a caller that prefills directly builds no training graph."""
        b, p = input_ids.shape
        if b != self.batch or p + new_tokens > self.max_len:
            raise MheError(f"this generator holds {self.batch} rows of {self.max_len} positions; got {b} prompts "
                           f"of {p} tokens + {new_tokens} new (build one with model.generator(batch, max_len))")
        self.padded = not bool(prompt_mask.all())
        plan = None
        if self.kernel is not None:
            plan = kernels.DecodePlan.of(self.kernel)
        elif not self.padded or _left_padded(prompt_mask):
            plan = kernels.decode_plan(self.model, self.device, self.dtype, batch=b, positions=self.max_len)
        self._build(plan)
        inputs = (input_ids, prompt_mask, positions)
        return self._prefill_runner(inputs)(*inputs)

    def _prefill_runner(self, inputs: tuple) -> Callable[..., torch.Tensor]:
        """How a prompt shape ``(rows, length, padded)`` runs: eagerly at its first call (a shape
        seen once is not worth a capture or a compile), then, in a session that captures its
        steps, replayed as a CUDA graph up to :data:`PREFILL_GRAPH_TOKENS` prompt tokens (the host
        launching eager kernels bounds such a prefill); from :data:`PREFILL_COMPILE_TOKENS`, in
        ``compile`` mode, compiled by inductor for that one shape (static shapes: a dynamic
        compile of the view took minutes), since a long prompt's eager prefill is bound by its
        separate memory-bound elementwise kernels, at most :data:`PREFILL_COMPILES` times a
        session (kept apart from the :data:`PREFILL_GRAPHS` newest captures, so none pushes them
        out)."""
        b, p = inputs[0].shape
        region, key, tokens = self._prefill_region(p), (b, p, self.padded), b * p
        small = tokens <= PREFILL_GRAPH_TOKENS
        kept = self.prefills if small else self.compiled_prefills
        if small:
            fast = self.mode != "eager" and self.device.type == "cuda"
        else:
            fast = (self.mode == "compile" and tokens >= PREFILL_COMPILE_TOKENS
                    and (key in kept.runners or self.prefill_compiles < PREFILL_COMPILES))
        if not fast or (key not in kept.runners and key not in self.prefills_seen):
            if fast:  # a shape's first call: eager, remembered (a bounded record)
                if len(self.prefills_seen) >= 64:
                    self.prefills_seen.clear()
                self.prefills_seen.add(key)
            return region
        if small:
            return kept.get(key, lambda: StepRunner(region, inputs, mode="graph", device=self.device))
        return kept.get(key, lambda: self._compiled_prefill(region))

    def _compiled_prefill(self, region: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """``region`` compiled with the caller's ``compile_options`` (not the one-row default),
        counted against :data:`PREFILL_COMPILES`."""
        self.prefill_compiles += 1
        return compile_step(region, device=self.device, options=self.options["compile_options"], what="prefill")

    def _prefill_region(self, p: int) -> Callable[..., torch.Tensor]:
        """The prefill of prompts of ``p`` tokens as one region (ids, mask, positions) -> the
        next token's logits ``[B, V]``: it empties the caches itself, so a capture's warm-ups
        leave nothing to undo."""
        view, caches, key_mask, plan, keys = self.view, self.caches, self.key_mask, self.plan, self.max_len
        padded = self.padded

        def region(input_ids, prompt_mask, positions):
            for c in caches:
                c.reset()
            key_mask.fill_(True)
            key_mask[:, :p] = prompt_mask
            mask = masks.self_attention_mask(input_ids, key_mask if padded else None, keys=keys)
            return view(input_ids, attention_mask=mask, caches=caches, position_ids=positions,
                        last_only=True, plan=plan).logits[:, -1]
        return region

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
        def make() -> StepRunner:
            model_step, choose = self._model_step(), self._chooser(rule)

            def region():
                logits = model_step()
                choose(logits)
                return logits
            watched = self.state.tensors() + [c.index for c in self.caches]
            generators = [rule.generator] if rule.generator else []
            return self.new_runner(region, mode="eager" if self.mode == "eager" else "graph",
                                   before_warmup=restorer(watched), generators=generators)
        return self.runners.get((self.padded, rule.key), make)()

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
            view, caches, state, plan = self.view, self.caches, self.state, self.plan
            key_mask = self.key_mask if self.padded else None

            def model_step():
                return view(state.tok, attention_mask=key_mask, caches=caches, position_ids=state.pos,
                            plan=plan).logits[:, -1]
            self._steps[self.padded] = model_step if self.mode != "compile" else compile_step(
                model_step, device=self.device, options=self.compile_options)
        return self._steps[self.padded]

    def _build(self, plan: kernels.DecodePlan | None) -> None:
        """The view of these weights and ``plan``, the session's decode choice from now on (None:
        the configured kernel); a new one drops the steps built on the old."""
        model = self.model
        p = next(model.parameters())
        if (p.dtype, p.device) != (self.dtype, self.device):
            raise MheError(f"this generator was built for {self.dtype} on {self.device}, the model is now "
                           f"{p.dtype} on {p.device}; build a new one with model.generator(batch, max_len)")
        def make():
            view = inference_view(model)
            view = shared_copy(model) if view is model else view  # never the model itself (weak reference)
            return fuse_projections(view)  # one product for Q, K, V: two kernels fewer a layer
        self.plan = plan  # the steps capture it: a new plan is a new build key, so new steps
        switches = (kv_cache.ROTARY_STEP,)  # captured steps keep the switch they were captured with
        if self.build((weights_version(model), plan, model.training, switches), make):
            self.prefills.clear()  # captured on the old view
            self.compiled_prefills.clear()
            self.prefills_seen.clear()  # a new view's shapes wait for their second call again
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
