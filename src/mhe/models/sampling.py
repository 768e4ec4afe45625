"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p."""

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
