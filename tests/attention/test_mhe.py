"""MHE's fast path against the literal reference (paper Eqs. 4-6, section 3.4) and
the identities of docs/paper-notes that make it run at multi-query cost."""

import pytest
import torch

from conftest import B, D_MODEL, N_HEADS, T
from mhe.attention import build_attention

MHE = ["mhe-add", "mhe-mul"]


def pair(kind, *, std=0.5, **kw):
    """A fast and a reference module with identical, non-trivial weights (float64)."""
    fast = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, impl="fast", **kw).double()
    with torch.no_grad():
        for p in fast.parameters():
            p.normal_(0, std)
    ref = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, impl="reference", **kw).double()
    ref.load_state_dict(fast.state_dict())
    return fast, ref


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


def grads(mod):
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in mod.named_parameters()}


CASES = [
    dict(name="self", causal=False, cross=False, padded=False),
    dict(name="causal", causal=True, cross=False, padded=False),
    dict(name="causal+padding", causal=True, cross=False, padded=True),
    dict(name="padding", causal=False, cross=False, padded=True),
    dict(name="cross", causal=False, cross=True, padded=False),
    dict(name="cross+padding", causal=True, cross=True, padded=True),
]


@pytest.mark.parametrize("kind", MHE)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("fold", ["weight", "activation"])
@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_fast_equals_reference_outputs_and_gradients(kind, bias, fold, case):
    fast, ref = pair(kind, bias=bias, causal=case["causal"], query_fold=fold)
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    s = 5 if case["cross"] else T
    ctx = torch.randn(B, s, D_MODEL, dtype=torch.float64) if case["cross"] else None
    mask = None
    if case["padded"]:
        mask = torch.ones(B, s, dtype=torch.bool)
        mask[1, s - 2:] = False
    out_f = fast(x, context=ctx, mask=mask)
    out_r = ref(x, context=ctx, mask=mask)
    assert rel_err(out_f, out_r) < 1e-10
    w = torch.randn_like(out_f)
    (out_f * w).sum().backward()
    (out_r * w).sum().backward()
    gf, gr = grads(fast), grads(ref)
    assert set(gf) == set(gr)
    for name in gf:
        scale = max(gr[name].norm().item(), gf[name].norm().item(), 1e-30)
        assert (gf[name] - gr[name]).norm().item() / scale < 1e-10 or scale < 1e-12, name


def test_mhe_add_key_embeddings_get_zero_gradient():
    """(Q+eQ_i)(K+eK_i)^T - (Q+eQ_i)K^T is constant along the keys, so softmax cancels it."""
    _, ref = pair("mhe-add", causal=True)
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    ref(x).square().sum().backward()
    g = ref.head_embed.grad
    assert g[1].abs().max().item() < 1e-12 * g[0].abs().max().item()
    assert g[0].abs().max().item() > 1e-3 and g[2].abs().max().item() > 1e-3
    # and changing eK leaves the output unchanged
    out = ref(x)
    with torch.no_grad():
        ref.head_embed[1].normal_(0, 3.0)
    torch.testing.assert_close(ref(x), out, rtol=1e-12, atol=1e-12)


def test_mhe_mul_is_multi_query_attention_with_rescaled_queries():
    """MHE-Mul = MQA whose head-i query weight is W^Q scaled by (1+eQ_i)(1+eK_i) and whose
    output projection columns are scaled by (1+eV_i) (paper-notes)."""
    mhe, _ = pair("mhe-mul", causal=True)
    mqa = build_attention("mqa", d_model=D_MODEL, n_heads=N_HEADS, causal=True).double()
    e = mhe.head_embed.detach()
    scale = (e[0] + 1) * (e[1] + 1)  # [n, d]
    with torch.no_grad():
        mqa.q_proj.weight.copy_((scale[:, :, None] * mhe.q_proj.weight[None]).reshape(-1, D_MODEL))
        mqa.k_proj.weight.copy_(mhe.k_proj.weight)
        mqa.v_proj.weight.copy_(mhe.v_proj.weight)
        mqa.out_proj.weight.copy_(mhe.out_proj.weight * (e[2] + 1).reshape(1, -1))
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    assert rel_err(mqa(x), mhe(x)) < 1e-12


def test_mhe_mul_with_zero_embeddings_is_sha():
    """Section 3.3: the seed projections alone are single-head attention."""
    mhe, _ = pair("mhe-mul")
    sha = build_attention("sha", d_model=D_MODEL, n_heads=N_HEADS).double()
    with torch.no_grad():
        mhe.head_embed.zero_()
    sha.load_state_dict({k: v for k, v in mhe.state_dict().items() if k != "head_embed"})
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    assert rel_err(sha(x), mhe(x)) < 1e-12


@pytest.mark.parametrize("kind", MHE)
def test_fast_equals_reference_under_attention_dropout(kind):
    """With the same random stream both paths drop the same attention weights. MHE-Add
    expands the values per head here, since dropped rows no longer sum to one."""
    fast, ref = pair(kind, causal=True, dropout=0.3)
    fast.train(), ref.train()
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    torch.manual_seed(7)
    out_f = fast(x)
    torch.manual_seed(7)
    out_r = ref(x)
    assert rel_err(out_f, out_r) < 1e-10
    torch.manual_seed(8)
    assert rel_err(fast(x), out_r) > 1e-3  # dropout really is on


def test_initialisation_is_documented_normal():
    mod = build_attention("mhe-mul", d_model=256, n_heads=8)
    e = mod.head_embed.detach()
    assert abs(e.std().item() - 0.02) < 0.003 and abs(e.mean().item()) < 0.003
    mod = build_attention("mhe-mul", d_model=256, n_heads=8, init_std=0.0)
    assert mod.head_embed.abs().max().item() == 0.0


@pytest.mark.parametrize("kind", MHE)
def test_bf16_error_within_twice_plain_bf16(kind):
    """flash-attention's rule: the fast path's error against an fp32 reference stays
    within about 2x the error of the literal implementation run in bf16."""
    torch.manual_seed(3)
    fast, ref = pair(kind, causal=True, std=0.2)
    x = torch.randn(4, 64, D_MODEL, dtype=torch.float64)
    gold = ref.float()(x.float()).double()
    fast_bf = fast.to(torch.bfloat16)(x.to(torch.bfloat16)).double()
    ref_bf = ref.to(torch.bfloat16)(x.to(torch.bfloat16)).double()
    err_fast, err_plain = rel_err(fast_bf, gold), rel_err(ref_bf, gold)
    assert err_fast <= 2 * err_plain + 1e-6, (err_fast, err_plain)
