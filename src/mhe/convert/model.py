"""``convert_model``: a trained multi-head model as another attention kind, every attention
sublayer fitted, everything else copied.

The model is read through its attention modules' state dicts (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj``) and rebuilt with the public builder (``build_model(cfg.replace(attention=kind))``),
so any model that holds multi-head sublayers under those names converts, grouped K/V included.
"""

from __future__ import annotations

import torch
from torch import nn

from mhe.attention.base import Attention
from mhe.attention.rotary import rotary_width
from mhe.convert.heads import read_heads
from mhe.convert.report import ConversionReport
from mhe.convert.sublayer import InputStats, convert_sublayer
from mhe.convert.targets import TARGETS
from mhe.errors import MheError
from mhe.models import build_model

SOURCES = ("mha", "gqa", "mqa")
"""Kinds with per-head projections: the ones a conversion starts from."""


def attention_modules(model: nn.Module) -> list[tuple[str, Attention]]:
    """(state-dict prefix, module) of every attention sublayer, in order."""
    return [(name, mod) for name, mod in model.named_modules() if isinstance(mod, Attention)]


def check_conversion(cfg, kind: str, n_kv_heads: int = 0) -> None:
    """Refuse what cannot be converted: one line naming the value and what is allowed."""
    if kind not in TARGETS:
        raise MheError(f"cannot convert to attention kind {kind!r}; valid targets: {', '.join(TARGETS)}")
    if cfg.attention not in SOURCES:
        raise MheError(f"the source model's attention is {cfg.attention!r}, not multi-head; conversion starts from "
                       f"{', '.join(SOURCES)}")
    if cfg.arch == "encoder-decoder":
        raise MheError("converting an encoder-decoder is not supported (its cross-attention reads the encoder); "
                       "valid architectures: decoder, encoder")
    if kind != "gqa" and n_kv_heads:
        raise MheError(f"n_kv_heads={n_kv_heads} applies to gqa only, not to {kind!r}")
    if n_kv_heads < 0 or (n_kv_heads and cfg.n_heads % n_kv_heads):
        raise MheError(f"n_kv_heads={n_kv_heads} must be a positive divisor of n_heads={cfg.n_heads} "
                       "(or 0: the default, n/4)")


def target_kv_heads(target: nn.Module) -> int:
    """The K/V heads of a built target model's first sublayer (what its cache holds per layer)."""
    mod = attention_modules(target)[0][1]
    return mod.cache_heads

def rotary_groups(cfg, head_dim: int) -> list[list[int]] | None:
    """Query/key columns that must share one MHE-Mul scale: the rotary pairs (RoPE pairs
    dimension j with j + r/2 for j < r/2 over its first r dimensions, the ``rotate_half`` layout
    of :mod:`mhe.attention.rotary`), or None for absolute positions. A rotation commutes with an
    elementwise scale only where the scale is equal within each pair (paper-notes, "MHE with
    rotary positions"), so only such scales keep the converted heads exact."""
    if getattr(cfg, "positions", "") != "rotary":
        return None
    r = rotary_width(head_dim, cfg.rope_fraction)
    return [[j, j + r // 2] for j in range(r // 2)] + [[j] for j in range(r, head_dim)]


@torch.no_grad()
def input_stats(model: nn.Module, batches) -> dict[str, InputStats]:
    """Mean and second moment of every attention sublayer's input over ``batches`` (token id
    tensors ``[B, T]``, or dicts of model inputs), accumulated in float64."""
    sums: dict[str, list] = {}

    def hook(name):
        def record(_mod, args):
            x = args[0].detach().to(torch.float64).flatten(0, -2)  # [tokens, m]
            s = sums.setdefault(name, [0, 0, 0])
            s[0] = s[0] + x.sum(0)
            s[1] = s[1] + x.T @ x
            s[2] += x.shape[0]
        return record

    handles = [mod.register_forward_pre_hook(hook(name)) for name, mod in attention_modules(model)]
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            model(**batch) if isinstance(batch, dict) else model(batch)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {name: InputStats(mean=(s[0] / s[2]).cpu(), second=(s[1] / s[2]).cpu(), count=s[2])
            for name, s in sums.items()}


def convert_model(model: nn.Module, kind: str, *, n_kv_heads: int = 0, calibration=None, align: bool = True,
                  align_iters: int = 20, naive: bool = False) -> tuple[nn.Module, ConversionReport]:
    """The ``kind`` model fitted to a trained multi-head (MHA, GQA or MQA) ``model``.

    Args:
        model: a decoder or encoder (``mhe.models``) with mha, gqa or mqa attention.
        kind: ``mhe-mul``, ``mhe-add``, ``mqa``, ``gqa`` or ``sha``
            (:mod:`mhe.convert.targets` says what each fit minimises).
        n_kv_heads: K/V heads of a ``gqa`` target (0: the default, n/4).
        calibration: token id tensors ``[B, T]`` (or dicts of model inputs) whose attention inputs
            fit MHE-Add's offsets and measure the errors on projected outputs; precomputed
            :func:`input_stats` are accepted too. None: weight space only.
        align: rotate each head towards the fit first (:mod:`mhe.convert.sublayer`); without it,
            MQA/GQA is Ainslie et al.'s plain mean pooling.
        align_iters: alternations of fit and Procrustes when aligning.
        naive: write the naive initialisation (mean of the heads, zero head embeddings).

    Returns:
        (the converted model, on the CPU in the source's dtype and mode; the report: per
        sublayer and role the relative reconstruction error of the fit beside the naive one).
    """
    cfg = model.cfg
    check_conversion(cfg, kind, n_kv_heads)
    stats = calibration if isinstance(calibration, dict) or calibration is None else input_stats(model, calibration)
    options = {"n_kv_heads": n_kv_heads} if kind == "gqa" else None  # 0: the kind's default
    dtype = next(model.parameters()).dtype
    target = build_model(cfg.replace(attention=kind, attn_options=options)).to(dtype)
    kv = target_kv_heads(target) if kind == "gqa" else 1
    source_state = model.state_dict()
    modules = attention_modules(model)
    prefixes = tuple(f"{name}." for name, _ in modules)
    state = {k: v for k, v in source_state.items() if not k.startswith(prefixes)}
    layers = []
    for name, mod in modules:
        own = {k[len(name) + 1:]: v for k, v in source_state.items() if k.startswith(f"{name}.")}
        heads = read_heads(own, n_heads=mod.cfg.n_heads, head_dim=mod.cfg.head_dim, where=name)
        res = convert_sublayer(heads, kind, kv_heads=kv, stats=(stats or {}).get(name), align=align,
                               align_iters=align_iters, qk_groups=rotary_groups(cfg, mod.cfg.head_dim), naive=naive)
        state.update({f"{name}.{k}": v for k, v in res.state.items()})
        layers.append((name, res.errors))
    try:
        target.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise MheError(f"the converted {kind} model does not take the fitted weights ({str(e).splitlines()[0]})") from e
    target = target.train(model.training)
    report = ConversionReport(source=cfg.attention, kind=kind, layers=layers,
                              options={"n_kv_heads": kv, "align": align, "naive": naive,
                                       "calibration_tokens": min((s.count for s in (stats or {}).values()),
                                                                 default=0)})
    return target, report
