"""``convert_model``: a trained multi-head model as another attention kind, every attention
sublayer fitted, everything else copied.

The model is read through its attention modules' state dicts (``q_proj``, ``k_proj``, ``v_proj``,
``out_proj``) and rebuilt with the public builder (``build_model(cfg.replace(attention=kind))``),
so any model that holds multi-head sublayers under those names converts, grouped K/V included.
Under rotary positions (the Llama-style decoder) each fit honours RoPE as
:mod:`mhe.convert.rotary` says, for the target's ``rope_order``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from mhe.attention.spec import AttentionSpec
from mhe.convert.fit import small_solves
from mhe.convert.heads import read_heads
from mhe.convert.options import target_options, target_spec
from mhe.convert.outputs import OutputFit, fit_outputs
from mhe.convert.report import ConversionReport
from mhe.convert.rotary import rotary_fit
from mhe.convert.stats import attention_modules, input_stats
from mhe.convert.sublayer import convert_sublayer
from mhe.errors import MheError
from mhe.models import build_model, require_model

SOURCES = ("mha", "gqa", "mqa")
"""Kinds with per-head projections: the ones a conversion starts from."""


def check_conversion(cfg, kind: str | AttentionSpec, n_kv_heads: int = 0, options: dict | None = None):
    """Refuse what cannot be converted (one line naming the value and what is allowed); returns
    the target's options dataclass (:func:`mhe.convert.options.target_options`). ``kind``: the
    target's spec (:func:`~mhe.convert.options.target_spec`; a name is parsed into it)."""
    spec = target_spec(kind)
    if cfg.attention not in SOURCES:
        raise MheError(f"the source model's attention is {cfg.attention!r}, not multi-head; conversion starts from "
                       f"{', '.join(SOURCES)}")
    if cfg.arch == "encoder-decoder":
        raise MheError("converting an encoder-decoder is not supported (its cross-attention reads the encoder); "
                       "valid architectures: decoder, encoder")
    if not spec.grouped and n_kv_heads:
        raise MheError(f"n_kv_heads={n_kv_heads} applies to gqa only, not to {spec.name!r}")
    if n_kv_heads < 0 or (n_kv_heads and cfg.n_heads % n_kv_heads):
        raise MheError(f"n_kv_heads={n_kv_heads} must be a positive divisor of n_heads={cfg.n_heads} "
                       "(or 0: the default, n/4)")
    opts = target_options(spec, n_kv_heads, options)
    cfg.replace(attention=spec, attn_options=opts)  # the target's configuration is valid (checks its options)
    return opts


def convert_model(model: nn.Module, kind: str | AttentionSpec, *, n_kv_heads: int = 0, options: dict | None = None,
                  calibration=None, align: bool = True, align_iters: int = 20,
                  naive: bool = False, output_fit: OutputFit | None = None, fit_batches=None,
                  recorded: dict | None = None, device="cpu") -> tuple[nn.Module, ConversionReport]:
    """The ``kind`` model fitted to a trained multi-head (MHA, GQA or MQA) ``model``.

    Args:
        model: a decoder or encoder (``mhe.models``) with mha, gqa or mqa attention, absolute or
            rotary positions.
        kind: the target's spec, or its name (parsed here, once): ``mhe-mul``, ``mhe-add``,
            ``mqa``, ``gqa`` or ``sha`` (:mod:`mhe.convert.targets` says what each fit minimises).
        n_kv_heads: K/V heads of a ``gqa`` target (0: the default, n/4).
        options: the target kind's ``model.attn_options`` (a dict; e.g. MHE's ``rope_order``,
            default ``rope-then-psi``), which the fit honours (:mod:`mhe.convert.rotary`).
        calibration: token id tensors ``[B, T]`` (or dicts of model inputs) whose attention inputs
            fit MHE-Add's offsets and measure the errors on projected outputs; precomputed
            :func:`input_stats` are accepted too. None: weight space only.
        align: rotate each head towards the fit first (:mod:`mhe.convert.sublayer`); without it,
            MQA/GQA is Ainslie et al.'s plain mean pooling.
        align_iters: alternations of fit and Procrustes when aligning.
        naive: write the naive initialisation (mean of the heads, zero head embeddings).
        output_fit: then fit every sublayer to the source's sublayer outputs on ``fit_batches``
            (token id tensors or dicts of model inputs, at least two batches; the last ones held
            out; or ``recorded``, those outputs recorded once by
            :func:`mhe.convert.outputs.record_sublayers`) (:mod:`mhe.convert.outputs`); None: the
            weight fit alone.
        device: where the fits run (the weight fits in float64, the output fit in the model's
            dtype): a GPU when given one, else the CPU.

    Returns:
        (the converted model, on the CPU in the source's dtype and mode; the report: per
        sublayer and role the relative reconstruction error of the fit beside the naive one).
    """
    require_model(model, "convert_model")
    cfg, spec = model.cfg, target_spec(kind)
    opts = check_conversion(cfg, spec, n_kv_heads, options)
    stats = calibration if isinstance(calibration, dict) or calibration is None else input_stats(model, calibration)
    dtype = next(model.parameters()).dtype
    target = build_model(cfg.replace(attention=spec, attn_options=opts)).to(dtype)
    first = attention_modules(target)[0][1]
    kv = spec.kv_heads(cfg.n_heads, opts)  # the fitted K/V heads: 1, or gqa's groups
    state, layers = _fit_sublayers(model, spec, kv, opts, stats or {}, torch.device(device), align=align,
                                   align_iters=align_iters, naive=naive)
    try:
        target.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise MheError(f"the converted {spec.name} model does not take the fitted weights "
                       f"({str(e).splitlines()[0]})") from e
    fitted = fit_outputs(model, target, fit_batches, output_fit, device, recorded) if output_fit and not naive \
        else None
    target, rotary = target.train(model.training), rotary_fit(cfg, first.cfg.head_dim, spec, opts)
    report = ConversionReport(source=cfg.attention, kind=spec.name, layers=layers,
                              options={"n_kv_heads": kv, "cache_heads": first.cache_heads,
                                       "attn_options": dataclasses.asdict(opts), "align": align, "naive": naive,
                                       "rotary": rotary.describe(spec) if rotary else None,
                                       "calibration_tokens": min((s.count for s in (stats or {}).values()),
                                                                 default=0)})
    if fitted is not None:
        report.options["output_fit"] = fitted
    return target, report


def _fit_sublayers(model: nn.Module, spec: AttentionSpec, kv: int, opts, stats: dict, device: torch.device,
                   **how) -> tuple[dict, list]:
    """The target's state dict (the source's, every attention sublayer's weights fitted, on the
    CPU) and, per sublayer, (name, errors). Each sublayer's heads and statistics are fitted on
    ``device`` in float64 (:func:`mhe.convert.fit.small_solves`)."""
    source_state = model.state_dict()
    modules = attention_modules(model)
    prefixes = tuple(f"{name}." for name, _ in modules)
    state = {k: v for k, v in source_state.items() if not k.startswith(prefixes)}
    layers = []
    with small_solves(device):
        for name, mod in modules:
            own = {k[len(name) + 1:]: v.to(device) for k, v in source_state.items() if k.startswith(f"{name}.")}
            heads = read_heads(own, n_heads=mod.cfg.n_heads, head_dim=mod.cfg.head_dim, where=name)
            own_stats = stats.get(name)
            res = convert_sublayer(heads, spec, kv_heads=kv, rotary=rotary_fit(model.cfg, mod.cfg.head_dim, spec, opts),
                                   stats=None if own_stats is None else own_stats.to(device), **how)
            state.update({f"{name}.{k}": v.cpu() for k, v in res.state.items()})
            layers.append((name, res.errors))
    return state, layers
