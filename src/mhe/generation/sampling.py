"""Choosing each new token on the device: the token state, the rule of a call, and sampling.

:class:`TokenState` holds the newest token of each row and its position (the next step's
inputs), how many new tokens there are, which rows have stopped and after how many tokens, and
the new tokens themselves. :meth:`TokenState.choose` applies a :class:`Rule` (greedy or
sampling, the stop tokens, whether ``min_new_tokens`` holds them back) to one step's logits;
the same code runs eagerly after the prompt and inside every replay of the captured step, so
eager and captured generation choose alike. The sampling functions read and write tensors only
(no host reads); the order of the filters and the draw are transformers' (temperature, then
top-k, then top-p on float32 logits, then one multinomial draw per row), so a seeded draw gives
transformers' tokens. This is the sampling policy of a decode session
(:class:`mhe.generation.session.Generator`); beam search is the other (:mod:`mhe.generation.beam`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mhe.errors import MheError, require_positive
from mhe.generation.step import note_non_finite, refuse_non_finite

__all__ = ["Rule", "SamplingConfig", "TokenState", "draw", "filter_logits", "next_token"]


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
        note_non_finite(self.bad, (top.isfinite() | self.done).logical_not().any(), self.count)

    def check_finite(self) -> None:
        """Refuse the call whose logits were not finite (a token drawn or picked from NaN is noise)."""
        refuse_non_finite(self.bad, lambda s: f"the logits of new token {s + 1} (generation step {s + 1})",
                          "no token can be chosen")

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
