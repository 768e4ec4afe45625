"""Generation for the decoder: prefill the prompt, then one captured step per token.

:func:`generate` is the loop. It runs the prompt once (SDPA, plain causal when nothing is
padded) into the static caches of a :class:`~mhe.models.generator.Generator` session, chooses the
first token, then replays one region per token: the model's decode step, the choice of the next
token (greedy, or :class:`~mhe.models.sampling.SamplingConfig`'s sampling) and the stop
bookkeeping, all on the device (:mod:`mhe.models.token_step`), as one CUDA graph on a GPU
(eager kernels, or compiled ones: :data:`~mhe.models.decode_step.CUDA_STEP_MODE`). The host
reads the device only to learn, every :data:`CHECK_EVERY` tokens, whether every row has stopped
(every token with a streamer). The caller may hold the session (``model.generator(batch,
max_len)``, passed as ``session=``); without one, the model's default session is reused
(:func:`~mhe.models.generator.default_session`).

Batches of prompts of different lengths are LEFT padded (``attention_mask`` 0 on the
left): positions count from each row's first real token and padding is never attended to,
so a row's continuation is the one it gets alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from mhe.errors import MheError, require_positive
from mhe.models.generator import Generator, default_session, release_default_sessions
from mhe.models.outputs import as_bool_mask
from mhe.models.sampling import SamplingConfig, filter_logits, next_token

__all__ = ["CHECK_EVERY", "GenerateOutput", "Generator", "SamplingConfig", "default_session", "filter_logits",
           "generate", "left_pad", "next_token", "release_default_sessions"]

CHECK_EVERY = 8  # tokens between the host's reads of whether every row has stopped


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
            ``compile_options`` and ``kernel`` (:func:`~mhe.models.generator.default_session`).
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
