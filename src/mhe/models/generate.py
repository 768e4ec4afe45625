"""Generation for the decoder: prefill the prompt, then one static decode step per token.

:func:`generate` is the loop; :class:`Generator` is what it keeps between calls and what the
caller holds to reuse it (``model.generator(batch, max_len)``, then ``model.generate(...,
session=gen)``): the inference view of the model (fast MHE folded to MQA, the decode kernel of
:func:`~mhe.models.decode_step.decode_kernel` set), the static KV caches, and the decode step
run by :class:`~mhe.models.decode_step.StepRunner` (eager, a replayed CUDA graph, or compiled
once). Without a session each call builds one. The prompt runs once (SDPA, plain causal when
nothing is padded) and fills the caches; every new token is then one call of the same step.

Batches of prompts of different lengths are LEFT padded (``attention_mask`` 0 on the
left): positions count from each row's first real token and padding is never attended to,
so a row's continuation is the one it gets alone. Tokens are chosen greedily or sampled
(:class:`SamplingConfig`: temperature, top-k, top-p).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mhe.attention import kernels, masks
from mhe.errors import MheError, require_positive
from mhe.models.decode_step import StepRunner, decode_kernel, inference_view, resolve_mode, restorer, weights_version
from mhe.models.outputs import as_bool_mask


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


class Generator:
    """The decoding state one caller reuses across :func:`generate` calls of ``batch`` prompts
    and up to ``max_len`` positions (prompt + new tokens): the view, the caches, the captured or
    compiled step. The view and step are rebuilt when the model's weights change.

    Args:
        step_mode: ``auto`` (CUDA graph on a GPU, eager on a CPU), ``eager``, ``graph``,
            ``compile``; ``compile_options`` go to ``torch.compile``.
        kernel: the attention kernel of every sublayer while decoding (:data:`KERNELS
            <mhe.attention.kernels.KERNELS>`); None: :func:`~mhe.models.decode_step.decode_kernel`'s
            choice, except for prompts whose mask is not left padding (a gap inside a row),
            which keep the configured kernels.
    """

    def __init__(self, model, batch: int, max_len: int, *, step_mode: str = "auto", kernel: str | None = None,
                 compile_options: dict | None = None) -> None:
        require_positive(batch=batch, max_len=max_len)
        p = next(model.parameters())
        self.model, self.batch, self.max_len = model, batch, max_len
        self.dtype, self.device = p.dtype, p.device  # of the weights, and so of the caches
        self.mode = resolve_mode(step_mode, self.device)
        self.kernel = kernels.check_kernel(kernel) if kernel is not None else None
        self.compile_options = compile_options
        self.view, self.caches, self.padded = None, None, False
        self.key_mask = torch.ones(batch, max_len, dtype=torch.bool, device=self.device)  # [B, L] over the caches
        self._built_for, self._runners = None, {}

    def prefill(self, input_ids: torch.Tensor, prompt_mask: torch.Tensor, positions: torch.Tensor,
                new_tokens: int) -> torch.Tensor:
        """Run the prompts ``[B, P]`` into empty caches, to be followed by up to ``new_tokens``
        tokens; the logits ``[B, V]`` of the next token."""
        b, p = input_ids.shape
        if b != self.batch or p + new_tokens > self.max_len:
            raise MheError(f"this generator holds {self.batch} rows of {self.max_len} positions; got {b} prompts "
                           f"of {p} tokens + {new_tokens} new (build one with model.generator(batch, max_len))")
        self.padded = not bool(prompt_mask.all())
        self._build(self.kernel or (decode_kernel(self.model, self.device, self.dtype)
                                    if not self.padded or _left_padded(prompt_mask) else None))
        for c in self.caches:
            c.reset()
        self.key_mask.fill_(True)
        self.key_mask[:, :p] = prompt_mask
        mask = masks.self_attention_mask(input_ids, self.key_mask if self.padded else None, keys=self.max_len)
        return self.view(input_ids, attention_mask=mask, caches=self.caches, position_ids=positions,
                         last_only=True).logits[:, -1]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` after the tokens ``[B, 1]`` at ``positions`` ``[B, 1]`` (the step's
        output tensor, reused by the next step)."""
        run = self._runners.get(self.padded)
        if run is None:
            key_mask = self.key_mask if self.padded else None

            def step(tok, pos):
                return self.view(tok, attention_mask=key_mask, caches=self.caches, position_ids=pos).logits[:, -1]
            run = self._runners[self.padded] = StepRunner(step, [tokens, positions], mode=self.mode,
                                                          before_warmup=restorer(self.caches),
                                                          compile_options=self.compile_options)
        return run(tokens, positions)

    def _build(self, kernel: str | None) -> None:
        """The view for ``kernel`` (None: the configured ones) and these weights; a new one drops
        the steps built on the old."""
        p = next(self.model.parameters())
        if (p.dtype, p.device) != (self.dtype, self.device):
            raise MheError(f"this generator was built for {self.dtype} on {self.device}, the model is now "
                           f"{p.dtype} on {p.device}; build a new one with model.generator(batch, max_len)")
        key = (weights_version(self.model), kernel)
        if key != self._built_for:
            self.view, self._runners, self._built_for = inference_view(self.model, kernel), {}, key
            if self.caches is None:
                self.caches = self.view.new_caches(self.batch, self.max_len, dtype=self.dtype, device=self.device)


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
        session: a :class:`Generator` to reuse (its caches and captured step, with its own
            settings); None builds one from ``step_mode``, ``compile_options`` and ``kernel``.
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
    dev, nxt = input_ids.device, positions[:, -1:] + 1  # [B, 1]: where each row's first new token sits
    gen, stops = sampling.generator(dev), torch.tensor(list(stop_ids), dtype=torch.long, device=dev)
    fill = pad_id if pad_id is not None else (int(stop_ids[0]) if len(stop_ids) else 0)
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=dev)
    made = torch.full_like(done, max_new_tokens, dtype=torch.long)  # new tokens per row, its stop included
    out, seen = [input_ids], []
    for i in range(max_new_tokens):
        if return_logits:
            seen.append(logits.clone())  # the step's output tensor is reused by the next step
        if i < min_new_tokens and len(stops):
            logits = logits.index_fill(-1, stops, float("-inf"))
        tok = torch.where(done, fill, next_token(logits, sampling, gen))  # [B]
        if len(stops):
            made = torch.where(done, made, i + 1)
            done = done | torch.isin(tok, stops)
        out.append(tok[:, None])
        if streamer is not None:
            streamer(tok.tolist())
        if i == max_new_tokens - 1 or (len(stops) and (i % 8 == 7 or streamer is not None) and bool(done.all())):
            break
        logits = session.step(tok[:, None], nxt + i)
    result = GenerateOutput(torch.cat(out, 1), done, torch.where(done, made, max_new_tokens),
                            torch.stack(seen, 1) if return_logits else None)
    if return_dict:
        return result
    return (result.tokens, result.logits) if return_logits else result.tokens


def _prompt(model, input_ids, attention_mask, max_new_tokens: int, min_new_tokens: int):
    """The prompts' boolean mask ``[B, P]`` and positions ``[B, P]`` (counted from each row's first
    real token), after checking the request."""
    require_positive(max_new_tokens=max_new_tokens)
    if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
        raise MheError(f"min_new_tokens must be a non-negative integer, got {min_new_tokens!r}")
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


def _session(model, input_ids, max_new_tokens: int, session: Generator | None, **options) -> Generator:
    """The caller's session, or a new one for this call (``options``: the step's settings)."""
    if session is None:
        return Generator(model, input_ids.shape[0], input_ids.shape[1] + max_new_tokens, **options)
    if options != {"step_mode": "auto", "kernel": None, "compile_options": None}:
        raise MheError("step_mode, kernel and compile_options belong to the session: give them to "
                       "model.generator(...)")
    return session


def _left_padded(prompt_mask: torch.Tensor) -> bool:
    """Every row is padding, then real tokens (reads the device)."""
    return bool((prompt_mask[:, 1:] >= prompt_mask[:, :-1]).all())


def left_pad(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, P]`` ids and mask, padded on the left (generation continues at the right edge)."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, width - len(r):] = 1
    return ids, mask


# --- choosing the next token: greedy, or sampling with temperature, top-k and top-p ---------------
@dataclass(frozen=True, kw_only=True)
class SamplingConfig:
    """How the next token is chosen.

    Attributes:
        do_sample: sample from the distribution (else greedy: the most likely token).
        temperature: divides the logits before sampling (> 0).
        top_k: keep only the k most likely tokens (0 = all).
        top_p: keep the smallest set of most likely tokens whose probability reaches top_p
            (nucleus sampling, Holtzman et al. 2020; 1.0 = all).
        seed: seeds a private generator, so the same call gives the same tokens.
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
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(self.seed)


def filter_logits(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Temperature, then top-k and top-p: ``[B, V]`` fp32 logits with removed tokens at -inf."""
    logits = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = logits.topk(cfg.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the more likely tokens
        drop = before >= cfg.top_p  # the most likely token is always kept
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of every row, ``[B]``, from last-position logits ``[B, V]``."""
    if not cfg.do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits, cfg).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
