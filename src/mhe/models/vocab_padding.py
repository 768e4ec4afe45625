"""The vocabulary padded for the GPU's matrix units, invisible to everything outside the step.

GPT-2's 50,257 tokens make the output projection ``[B*T, m] x [m, 50257]`` a GEMM whose
N dimension is no multiple of the tensor cores' tiles; padded to 50,304 (a multiple of 64)
the same GEMM runs on full tiles (nanoGPT's and llm.c's padded vocabulary). Here the padding
is a property of the *parameters* only:

* the token embedding (and the output layer tied to it, or an untied one with its bias)
  holds ``V_pad`` rows; rows ``V .. V_pad-1`` are zero and stay zero (no token id reaches
  them, no label scores them, so their gradient is exactly zero and AdamW leaves them at 0);
* every model output slices (or, in the chunked loss, masks) the scores back to the ``V``
  real tokens before any softmax, loss or sampling;
* ``state_dict()`` returns the real ``[V, m]`` tensors and ``load_state_dict`` accepts them
  (module state-dict hooks), and so do the optimiser's state dicts
  (:func:`pad_optimizer_state`): run folders, checkpoints, Hugging Face export and import,
  ``mhe params`` and resumes on another device never see the padding.

The real rows are initialised before padding (:func:`pad_vocabulary` copies them into the
larger zero tensor), so the random numbers drawn at initialisation are the same, in the same
order, with padding or without.

Padding is applied by the trainer on CUDA only: the tensor-core tiles it serves exist only
there, and on a CPU the larger gradient tensors would change the summation order of the
gradient norm (and so, after clipping, every later step in the last bits); CPU runs stay
bit-identical to unpadded training.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

PAD_MULTIPLE = 64  # tensor-core tile width in elements for bf16 GEMMs


def padded_size(vocab: int, multiple: int = PAD_MULTIPLE) -> int:
    """``vocab`` rounded up to a multiple of ``multiple`` (50257 -> 50304 at 64)."""
    return -(-vocab // multiple) * multiple


def vocab_parameters(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, attribute) of each parameter with one row per token: the modules a model lists
    in ``vocab_modules`` (its token embedding and output layer), their weights and biases. A model
    without an output layer over the vocabulary (classifiers, the adaptive softmax) lists none."""
    out = []
    for name in getattr(model, "vocab_modules", ()):
        mod = model.get_submodule(name)
        out += [(mod, attr) for attr in ("weight", "bias") if getattr(mod, attr, None) is not None]
    return out


def vocab_padding(model: nn.Module) -> int:
    """How many padding rows ``model``'s vocabulary matrices hold (0: not padded)."""
    params = vocab_parameters(model)
    return getattr(params[0][0], params[0][1]).shape[0] - model.cfg.vocab_size if params else 0


def padding_numel(model: nn.Module) -> int:
    """The number of parameter elements that are padding (each distinct tensor counted once)."""
    extra = vocab_padding(model)
    seen = {id(getattr(m, a)): getattr(m, a) for m, a in vocab_parameters(model)}
    return sum(extra * p[0].numel() for p in seen.values()) if extra else 0


def pad_vocabulary(model: nn.Module, multiple: int = PAD_MULTIPLE) -> int:
    """Give ``model``'s vocabulary matrices ``padded_size(V)`` rows in place (zeros after the
    real ones; tied weights stay tied) and register the state-dict hooks that hide the padding.
    Returns the padded size (``V`` when the model has nothing to pad or is padded already)."""
    vocab = model.cfg.vocab_size
    params = vocab_parameters(model)
    size = padded_size(vocab, multiple)
    if not params or size == vocab or vocab_padding(model):
        return vocab + vocab_padding(model)
    new: dict[int, nn.Parameter] = {}
    for mod, attr in params:
        old = getattr(mod, attr)
        if id(old) not in new:
            data = old.detach().new_zeros((size, *old.shape[1:]))
            data[:vocab] = old.detach()
            new[id(old)] = nn.Parameter(data, requires_grad=old.requires_grad)
        setattr(mod, attr, new[id(old)])
    padded = {id(p) for p in new.values()}
    keys = tuple(k for k, p in model.named_parameters(remove_duplicate=False) if id(p) in padded)
    post = getattr(model, "register_state_dict_post_hook", None) or model._register_state_dict_hook
    post(functools.partial(_real_rows, keys=keys, vocab=vocab))
    model.register_load_state_dict_pre_hook(functools.partial(_padded_rows, keys=keys, vocab=vocab, size=size))
    return size


def _real_rows(module, state_dict, prefix, local_metadata, *, keys, vocab) -> None:
    for k in keys:
        if prefix + k in state_dict:
            state_dict[prefix + k] = state_dict[prefix + k][:vocab]


def _padded_rows(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors, *,
                 keys, vocab, size) -> None:
    for k in keys:
        t = state_dict.get(prefix + k)
        if t is not None and t.shape[0] == vocab:
            state_dict[prefix + k] = _pad(t, size)


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    out = t.new_zeros((size, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def pad_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Make ``optimizer``'s state dicts hold the real ``[V, ...]`` rows of ``model``'s padded
    parameters (its moments), as the model's own state dict does, so that a checkpoint resumes
    with or without padding."""
    vocab, extra = model.cfg.vocab_size, vocab_padding(model)
    if not extra:
        return
    padded = {id(getattr(m, a)) for m, a in vocab_parameters(model)}
    index = [i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]) if id(p) in padded]

    def resized(state: dict, rows: int, change) -> dict:
        slots = {i: ({k: change(v) if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v
                      for k, v in s.items()} if i in index else s) for i, s in state["state"].items()}
        return {**state, "state": slots}

    def cut(opt, state):
        return resized(state, vocab + extra, lambda v: v[:vocab])

    def grow(opt, state):
        return resized(state, vocab, lambda v: _pad(v, vocab + extra))

    optimizer.register_state_dict_post_hook(cut)
    optimizer.register_load_state_dict_pre_hook(grow)
