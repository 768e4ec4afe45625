"""AdamW and learning-rate schedules built on ``LambdaLR``."""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from mhe.training.config import TrainConfig


def lr_factor(step: int, *, schedule: str, warmup: int, total: int, restarts: int = 1) -> float:
    """Multiplier of the peak learning rate at ``step`` (0-based).

    * linear: warm up, then decay linearly to 0 at ``total`` (BERT; Appendix B pre-training);
    * cosine: warm up, then a half cosine to 0;
    * cosine_restarts: warm up, then ``restarts`` cosine cycles, each jumping back to the peak
      (Appendix B fine-tuning: "cosine with hard restarts");
    * inverse_sqrt: Vaswani et al. (2017) Eq. 3 shape, normalised to 1 at the end of warmup;
    * constant: warm up, then flat.
    """
    if warmup and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    if schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / (step + 1))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    if progress >= 1.0:
        return 0.0
    return 0.5 * (1.0 + math.cos(math.pi * ((restarts * progress) % 1.0)))


def warmup_steps(t: TrainConfig) -> int:
    return int(round(t.warmup_ratio * t.steps)) if t.warmup_ratio > 0 else t.warmup_steps


def param_groups(model: torch.nn.Module, t: TrainConfig) -> list[dict]:
    """AdamW's parameter groups: no weight decay on biases, LayerNorm weights and MHE head
    embeddings (1-D or embedding-like vectors, as BERT leaves out biases and LayerNorm); each
    trainable parameter once (tied ones are one)."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 or name.endswith("head_embed") else decay).append(p)
    return [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, t: TrainConfig):
    """AdamW over :func:`param_groups` with its schedule. On CUDA the fused implementation (one
    kernel for every parameter's update, no host synchronisation); elsewhere the default one,
    whose results the CPU tests and figures were made with."""
    groups = param_groups(model, t)
    params = [p for g in groups for p in g["params"]]
    fused = bool(params) and all(p.is_cuda for p in params)
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps, **({"fused": True} if fused else {}))
    w = warmup_steps(t)
    sched = LambdaLR(opt, lambda s: lr_factor(s, schedule=t.schedule, warmup=w, total=t.steps, restarts=t.restarts))
    return opt, sched
