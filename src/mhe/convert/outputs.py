"""The output fit (``mhe convert --fit outputs``): each converted attention sublayer fitted to
what the source's sublayer computes on calibration tokens, not only to its weights.

The weight fits (:mod:`mhe.convert.targets`) match each projection on its own; what a head
computes is a softmax of products of them, and under rotary positions MHE-Mul's scales are held
equal within each rotary pair, so the weight-space optimum can be far from the best sublayer
(``results/uptrain-llama-6x512``: the fitted MHE-Mul starts above the naive mean of the heads).
Here every sublayer is fitted on its own, layer-wise, with the source's inputs: the source model
runs once over the calibration sequences and each attention sublayer's input x (with its
positions and mask) and output y are recorded; then, starting from the weight fit, a short Adam
descent on all of the converted sublayer's parameters at once (the shared projections, the head
embeddings and the output projection, solved jointly) minimises the relative squared error
sum ||f(x) - y||^2 / sum ||y||^2 on some of the sequences. The rest are held out: the state kept
is the one of lowest held-out error among the weight fit and a few states along the descent, so
the output fit's error on held-out calibration tokens never exceeds the weight fit's (the report
gives both, per sublayer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from mhe.convert.stats import attention_modules
from mhe.errors import MheError

CHECKS = 10
"""Held-out evaluations during one sublayer's fit (the best state is kept)."""

BATCH = 8
"""Calibration sequences per batch (:func:`mhe.convert.runs.calibration_batches`)."""


@dataclass(frozen=True)
class OutputFit:
    """How the output fit runs: ``steps`` Adam steps per sublayer at learning rate ``lr``, one
    calibration batch a step (in turn; the rate decays on a cosine), the last ``held_out`` share of
    the batches (at least one) kept to choose the state: the weight fit or the best one met."""

    steps: int = 200
    lr: float = 1e-3
    held_out: float = 0.25

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise MheError(f"--fit-steps must be a number of steps >= 1, got {self.steps}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise MheError(f"--fit-lr must be a learning rate > 0, got {self.lr}")
        if not 0 < self.held_out < 1:
            raise MheError(f"the output fit's held-out share must be in (0, 1), got {self.held_out}")

    def split(self, batches: list) -> tuple[list, list]:
        """(fitted batches, held-out batches); refuses fewer than two batches."""
        if len(batches) < 2:
            raise MheError(f"--fit outputs needs at least {BATCH + 1} calibration sequences (--calibration; one batch "
                           f"of {BATCH} is held out), got {len(batches)} batch(es)")
        held = min(len(batches) - 1, max(1, round(self.held_out * len(batches))))
        return batches[:-held], batches[-held:]


@torch.no_grad()
def record_sublayers(model: nn.Module, batches: list) -> dict[str, list[tuple]]:
    """Per attention sublayer, one ``(x, kwargs, y)`` per batch: its input, keyword arguments
    (positions, mask) and output as the source model computes them (eval mode)."""
    seen: dict[str, list[tuple]] = {name: [] for name, _ in attention_modules(model)}
    pending: dict[str, tuple] = {}

    def before(name):
        def hook(mod, args, kwargs):
            pending[name] = (args[0].detach(), {k: v for k, v in kwargs.items() if k != "cache"})
        return hook

    def after(name):
        def hook(mod, args, kwargs, out):
            x, kw = pending.pop(name)
            seen[name].append((x, kw, out.detach()))
        return hook

    handles = []
    for name, mod in attention_modules(model):
        handles.append(mod.register_forward_pre_hook(before(name), with_kwargs=True))
        handles.append(mod.register_forward_hook(after(name), with_kwargs=True))
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return seen


def output_error(mod: nn.Module, data: list[tuple]) -> float:
    """sqrt(sum ||f(x) - y||^2 / sum ||y||^2) of sublayer ``mod`` over recorded ``(x, kwargs, y)``."""
    num = den = 0.0
    with torch.no_grad():
        for x, kw, y in data:
            num += float((mod(x, **kw) - y).double().pow(2).sum())
            den += float(y.double().pow(2).sum())
    return math.sqrt(num / den) if den > 0 else 0.0


def fit_sublayer(mod: nn.Module, data: list[tuple], fit: OutputFit) -> dict:
    """Fit ``mod`` (in place) to the recorded outputs as the module docstring says; returns the
    held-out errors of the weight fit and of the output fit, and which one was kept.

    The learning rate decays to zero on a cosine over the steps, and the held-out error is read
    :data:`CHECKS` times along the way: the state kept is the one with the lowest held-out error
    (the weight fit's included), so an overshooting step size or overfitting costs nothing."""
    fitted, held = fit.split(data)
    best_state = {k: v.detach().clone() for k, v in mod.state_dict().items()}
    before = best = output_error(mod, held)
    params = [p for p in mod.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=fit.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.5 * (1 + math.cos(math.pi * i / fit.steps)))
    every = max(1, fit.steps // CHECKS)
    was_training = mod.training
    mod.eval()  # no dropout: the source's outputs were recorded without it
    for step in range(1, fit.steps + 1):
        x, kw, y = fitted[(step - 1) % len(fitted)]
        with torch.enable_grad():
            loss = (mod(x, **kw) - y).pow(2).sum() / y.pow(2).sum().clamp_min(1e-30)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        sched.step()
        if step % every == 0 or step == fit.steps:
            err = output_error(mod, held)
            if err < best:
                best, best_state = err, {k: v.detach().clone() for k, v in mod.state_dict().items()}
    mod.train(was_training)
    mod.load_state_dict(best_state)
    return {"weight_fit": before, "output_fit": best, "kept": "outputs" if best < before else "weights",
            "held_out_tokens": sum(x.shape[0] * x.shape[1] for x, _, _ in held)}


def fit_outputs(source: nn.Module, target: nn.Module, batches, fit: OutputFit,
                device: torch.device | str = "cpu", recorded: dict[str, list[tuple]] | None = None) -> dict:
    """Fit every attention sublayer of ``target`` (the weight-fitted conversion of ``source``,
    in place) to ``source``'s sublayer outputs on ``batches``, layer by layer with the source's
    inputs, on ``device`` (both models are returned to the CPU). ``recorded``: those inputs and
    outputs already recorded (:func:`record_sublayers` of ``source`` on the batches; a study that
    converts one source several times records it once), in place of running ``source`` here.
    Returns the report's record: the settings and, per sublayer, its :func:`fit_sublayer` record."""
    if recorded is None and not batches:
        raise MheError("the output fit needs calibration sequences (--calibration > 0 and a corpus, --data)")
    fit.split(list(batches) if recorded is None else next(iter(recorded.values()), []))  # too few: refused first
    dtype = next(target.parameters()).dtype
    try:
        if recorded is None:
            recorded = record_sublayers(source.to(device), [_to(b, device) for b in batches])
        target.to(device)
        layers = []
        for name, mod in attention_modules(target):
            data = [(x.to(device, dtype), _to(kw, device), y.to(device, dtype)) for x, kw, y in recorded[name]]
            layers.append({"sublayer": name, **fit_sublayer(mod, data, fit)})
    finally:
        source.cpu()
        target.cpu()
    return {"steps": fit.steps, "lr": fit.lr, "held_out": fit.held_out, "layers": layers}


def _to(batch, device):
    if isinstance(batch, dict):
        return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
    return batch.to(device)
