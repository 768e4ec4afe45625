"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p.

Every function here reads and writes tensors only (no host reads), so the choice runs inside
the captured per-token step of :mod:`mhe.models.token_step`. The order of the filters and the
draw are transformers' (``generate``'s sampling: temperature, then top-k, then top-p on float32
logits, then one multinomial draw per row), so a seeded draw gives transformers' tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mhe.errors import MheError, require_positive


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
