"""Inference-time weight folding: a trained MHE sublayer becomes a plain multi-query one.

The folded weights are the MHE module's own (``folded_query``, ``folded_output`` in
:mod:`mhe.attention.mhe`, from the identities in docs/paper-notes.md), the ones its fast
path computes with; the value offsets of MHE-Add become an output bias, exact without
attention dropout, i.e. at inference. The folded module is an ``mqa`` sublayer, so generation
uses its one-head KV cache and nothing else changes; it shares the key and value projections
with the MHE module and holds only its folded query and output weights.

Only a sublayer whose identity makes it a plain MQA sublayer folds (``foldable``: the fast path
without rotary positions). Under rotary positions MHE applies its per-head query factors after
the rotation, which no (n*d) x m query weight can express; such a sublayer is left as it is
(its fast path already caches one K/V head) and :func:`fold_mhe` refuses it.

:func:`inference_view` is what generation and beam search run: the model with every foldable
MHE sublayer folded, sharing every other weight, so MHE decodes exactly like MQA with no
per-step folding work. The decode kernel is not the view's: a session passes its
:class:`~mhe.attention.kernels.DecodePlan` down each call.
:func:`weights_version` tells a holder of a view when the model's weights changed under it.
"""

from __future__ import annotations

import copy
import dataclasses
import torch
from torch import nn

from mhe.attention.mhe import _MHEBase
from mhe.attention.registry import attention_from_config
from mhe.attention.spec import attention_spec
from mhe.errors import MheError


@torch.no_grad()
def fold_mhe(mod: _MHEBase) -> nn.Module:
    """The multi-query sublayer that computes what ``mod`` computes in eval mode: the query and
    output weights are the module's own folded ones (``folded_query``, ``folded_output``), the
    key and value projections are ``mod``'s own modules, shared (nothing is copied)."""
    if mod.rotary is not None:
        raise MheError(f"an {mod.kind} sublayer under rotary positions has no folded multi-query form "
                       "(its per-head factors act after the rotation); run it as it is")
    w_q, b_q = mod.folded_query()  # [n*d, m], [n*d] or None
    w_o, b_o = mod.folded_output()  # [m, n*d], [m] or None
    target = attention_spec(mod.spec.folds_to)
    # the sublayer's own typed configuration with the target's options and the folded biases
    cfg = dataclasses.replace(mod.cfg, bias=mod.cfg.bias or b_q is not None or b_o is not None, qkv_bias=False,
                              options=target.options())
    with torch.device("meta"):  # shapes only: every weight is set below, so skip the random init
        mqa = attention_from_config(target, cfg)
    mqa.k_proj, mqa.v_proj = mod.k_proj, mod.v_proj
    for lin, weight, bias in ((mqa.q_proj, w_q, b_q), (mqa.out_proj, w_o, b_o)):
        lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
        lin.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
    return mqa.train(mod.training)


def fold_model(model: nn.Module) -> nn.Module:
    """Replace every foldable MHE sublayer of ``model`` (in place) by its folded MQA form; fast MHE
    under rotary positions stays (see the module docstring).

    Computes the same function in eval mode; every weight outside the folded sublayers is
    kept bit for bit (the same tensors)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, _MHEBase) and child.foldable:
                setattr(parent, name, fold_mhe(child))
    return model


# --- the inference view: what generation and beam search run --------------------------------------
def inference_view(model: nn.Module) -> nn.Module:
    """``model`` with foldable MHE sublayers folded to MQA (fast MHE under rotary positions runs as it
    is, with its one-head cache); shares all parameters and buffers with ``model``, which is left
    unchanged (``model`` itself when nothing folds). Computes the same function as ``model`` (the
    folded sublayers by the identities above), built only from the attention package's own
    classes, so model code never branches on an attention kind."""
    if not any(isinstance(m, _MHEBase) and m.foldable for m in model.modules()):
        return model
    return fold_model(shared_copy(model)).eval()


def shared_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model``'s modules that shares every parameter and buffer with it (a view that
    holds no reference to ``model`` itself)."""
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    return copy.deepcopy(model, memo)


def weights_version(model: nn.Module) -> tuple:
    """Changes whenever a parameter is modified in place (an optimiser step, a load) or replaced
    (``model.to(...)``)."""
    return tuple((p.data_ptr(), p._version) for p in model.parameters())
