"""What happens to a token after the model scored it, on the device: the per-token bookkeeping
of generation in static tensors, so that the model's step, the choice of the next token and the
stop bookkeeping are one captured region (:class:`~mhe.models.decode_step.StepRunner`) and the
host loop replays it once per token and reads nothing back but, every few tokens, whether
every row has stopped.

:class:`TokenState` holds the newest token of each row and its position (the next step's
inputs), how many new tokens there are, which rows have stopped and after how many tokens, and
the new tokens themselves. :meth:`TokenState.choose` applies a :class:`Rule` (how to choose:
greedy or :class:`~mhe.models.sampling.SamplingConfig`, the stop tokens, whether
``min_new_tokens`` holds them back) to one step's logits and advances the state; the same code
runs eagerly after the prompt and inside every replay, so eager and captured generation choose
alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mhe.errors import MheError
from mhe.models.sampling import SamplingConfig, next_token


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
        broken = (~torch.isfinite(logits.amax(-1)) & ~self.done).any()  # no host read: noted in `bad`
        self.bad.copy_(torch.where((self.bad < 0) & broken, self.count, self.bad))
        if rule.hold_back:  # transformers' min_new_tokens: stop tokens at -inf until then
            held = logits.index_fill(-1, rule.stops, float("-inf"))
            logits = torch.where(self.count < self.min_new, held, logits)
        tok = torch.where(self.done, self.fill, next_token(logits, rule.sampling, rule.generator))  # [B]
        if rule.stops is not None:
            self.made.copy_(torch.where(self.done, self.made, self.count + 1))
            self.done.copy_(self.done | (tok[:, None] == rule.stops).any(-1))
        self.out.index_copy_(1, self.count.view(1), tok[:, None])
        self.tok.copy_(tok[:, None])
        self.pos.add_(1)
        self.count.add_(1)

    def check_finite(self) -> None:
        """Refuse the call whose logits were not finite (a token drawn or picked from NaN is noise)."""
        step = int(self.bad)
        if step >= 0:
            raise MheError(f"the logits of new token {step + 1} (generation step {step + 1}) are not finite "
                           "(NaN or inf): the model's weights or activations are; no token can be chosen")

    def new_tokens(self, limit: int) -> torch.Tensor:
        """``[B]`` new tokens per row: a stopped row's count, else ``limit``."""
        return torch.where(self.done, self.made, limit)
