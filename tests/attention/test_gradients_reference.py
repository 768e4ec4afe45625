"""Gradients of every attention kind against tests/reference.py's literal equations.

The module's own ``impl="reference"`` shares ``Attention.forward`` and the kernel with the
fast path, so it cannot catch a wrong backward in either; here both the module and the
head-by-head equations of tests/reference.py are backpropagated in float64 with the same
random output gradient, and every parameter's gradient (q/k/v/o projections and biases,
MHE head embeddings, mixing weights) and the inputs' gradients must agree to rounding.
"""

import pytest
import torch

from conftest import B, D_MODEL, N_HEADS, T
from mhe.attention import KINDS, attention_class, build_attention
from reference import reference_forward

CAUSAL_KINDS = [k for k in KINDS if k != "fnet"]
CROSS_KINDS = [k for k in KINDS if attention_class(k).supports_cross]
MHE_VARIANTS = [dict(impl="reference"), dict(query_fold="activation")]
TOL = dict(rtol=1e-10, atol=1e-12)


def make(kind, **kw):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    if kind == "linear":
        opts["max_len"] = 16
    opts.update(kw)
    mod = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, bias=True, **opts).double()
    with torch.no_grad():  # non-trivial values everywhere, biases and head embeddings included
        for p in mod.parameters():
            p.normal_(0, 0.3)
    return mod.eval()


def padding_mask(s):
    """Right padding of different lengths; the first key is always kept (no empty rows)."""
    mask = torch.ones(B, s, dtype=torch.bool)
    mask[0, s - 2:] = False
    mask[1, 3:] = False
    return mask


def grads(fn, mod, inputs, cotangent):
    """d(sum(fn() * cotangent)) with respect to every parameter (by name) and every input."""
    params = dict(mod.named_parameters())
    out = fn()
    g = torch.autograd.grad((out * cotangent).sum(), [*params.values(), *inputs], allow_unused=True)
    named = dict(zip(params, g[:len(params)]))
    named.update({f"input{i}": gi for i, gi in enumerate(g[len(params):])})
    return {k: torch.zeros_like(params[k]) if v is None else v for k, v in named.items()}


def assert_same_gradients(mod, x, *, context=None, mask=None):
    inputs = [x] if context is None else [x, context]
    for t in inputs:
        t.requires_grad_(True)
    cot = torch.randn(B, x.shape[1], D_MODEL, dtype=torch.float64)
    got = grads(lambda: mod(x, context=context, mask=mask), mod, inputs, cot)
    want = grads(lambda: reference_forward(mod, x, context=context, mask=mask), mod, inputs, cot)
    assert got.keys() == want.keys()
    for name in want:
        assert want[name].abs().max() > 0 or name == "head_embed", f"{name}: reference gradient is zero"
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m, n=name: f"gradient of {n}: {m}")


def x64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_gradients_match_reference(kind):
    mod = make(kind, causal=True)
    assert_same_gradients(mod, x64(B, T, D_MODEL))


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_padded_gradients_match_reference(kind):
    mod = make(kind, causal=True)
    assert_same_gradients(mod, x64(B, T, D_MODEL), mask=padding_mask(T))


@pytest.mark.parametrize("kind", KINDS)
def test_padded_bidirectional_gradients_match_reference(kind):
    mod = make(kind, causal=False)
    assert_same_gradients(mod, x64(B, T, D_MODEL), mask=padding_mask(T))


@pytest.mark.parametrize("kind", CROSS_KINDS)
def test_cross_attention_gradients_match_reference(kind):
    mod = make(kind, causal=True)  # causal is ignored for cross-attention
    assert_same_gradients(mod, x64(B, T, D_MODEL), context=x64(B, 5, D_MODEL), mask=padding_mask(5))


@pytest.mark.parametrize("kind", ["mhe-add", "mhe-mul"])
@pytest.mark.parametrize("variant", MHE_VARIANTS, ids=lambda v: "-".join(f"{k}={x}" for k, x in v.items()))
def test_mhe_implementations_gradients_match_reference(kind, variant):
    mod = make(kind, causal=True, **variant)
    assert_same_gradients(mod, x64(B, T, D_MODEL), mask=padding_mask(T))


def test_mhe_head_embedding_gradients_are_exercised():
    """The head embeddings that matter get a non-zero gradient (MHE-Add's key offsets cancel
    in softmax, section 3.4, so theirs is zero in the equations too)."""
    for kind, live in (("mhe-mul", (0, 1, 2)), ("mhe-add", (0, 2))):
        mod = make(kind, causal=True)
        x = x64(B, T, D_MODEL)
        mod(x).pow(2).sum().backward()
        for role in live:
            assert mod.head_embed.grad[role].abs().min() > 0, (kind, role)
