"""Rotary positions in every attention kind with a cache, and MHE under RoPE in both orders,
against tests/reference.py's head-by-head equations in float64: outputs and gradients.

docs/paper-notes.md ("MHE with rotary positions"): with the head embeddings acting after the
rotation (``rope-then-psi``) both folding identities hold, so the fast path keeps one shared
K/V head; acting before it (``psi-then-rope``) they fail, and the sublayer caches n heads.
"""

import pytest
import torch

from conftest import B, D_MODEL, N_HEADS, T
from mhe.attention import KINDS, attention_class, build_attention
from mhe.attention.folding import fold_mhe, fold_model, inference_view
from mhe.attention.rotary import RotaryEmbedding
from mhe.errors import MheError
from reference import reference_forward

ROTARY_KINDS = [k for k in KINDS if attention_class(k).supports_cache]
HEAD_DIM = D_MODEL // N_HEADS
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [4, 5, 9, 12, 13, 20, 31]])  # [B, T]: a gap, an offset
TOL = dict(rtol=1e-10, atol=1e-12)


def make(kind, *, fraction=1.0, **kw):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    mod = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, causal=True, bias=True, **opts, **kw).double()
    with torch.no_grad():  # non-trivial values everywhere, head embeddings far from zero
        for p in mod.parameters():
            p.normal_(0, 0.5)
    mod.attach_rotary(RotaryEmbedding(HEAD_DIM, base=500.0, fraction=fraction, max_len=32))
    return mod.eval()


def grads(fn, mod, x, cot):
    params = dict(mod.named_parameters())
    g = torch.autograd.grad((fn() * cot).sum(), [*params.values(), x], allow_unused=True)
    out = {k: torch.zeros_like(params[k]) if v is None else v for k, v in zip(params, g[:-1])}
    out["input"] = g[-1]
    return out


def assert_matches_reference(mod, mask=None):
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(mod(x, positions=POSITIONS, mask=mask),
                               reference_forward(mod, x, mask=mask, positions=POSITIONS), **TOL)
    cot = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    got = grads(lambda: mod(x, positions=POSITIONS, mask=mask), mod, x, cot)
    want = grads(lambda: reference_forward(mod, x, mask=mask, positions=POSITIONS), mod, x, cot)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)
    return got


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("kind", ROTARY_KINDS)
def test_every_kind_with_a_cache_rotates_queries_and_keys(kind, fraction):
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 4:] = False  # padding; every causal row keeps its first key
    assert_matches_reference(make(kind, fraction=fraction), mask)


MHE_VARIANTS = [dict(), dict(query_fold="activation"), dict(impl="reference")]


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("variant", MHE_VARIANTS, ids=["fast", "fast-activation", "reference"])
@pytest.mark.parametrize("order", ["rope-then-psi", "psi-then-rope"])
@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_mhe_under_rope_equals_the_literal_equations(kind, order, variant, fraction):
    mod = make(kind, fraction=fraction, rope_order=order, **variant)
    got = assert_matches_reference(mod)
    fast_shared = order == "rope-then-psi" and "impl" not in variant
    assert mod.cache_heads == (1 if fast_shared else N_HEADS)
    assert mod.new_cache(B, 8).k.shape[1] == mod.cache_heads
    e_k = got["head_embed"][1]
    if kind == "mhe-add" and order == "rope-then-psi":  # the key offsets stay inert after the rotation
        assert float(e_k.abs().max()) < 1e-12
    else:
        assert float(e_k.abs().max()) > 1e-3


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_the_two_orders_are_different_functions(kind):
    """The identity fails before the rotation: psi-then-rope is not rope-then-psi (issue's check:
    softmax gaps of 0.70 and 0.63 on random data), so the option changes the model."""
    a = make(kind, rope_order="rope-then-psi")
    b = make(kind, rope_order="psi-then-rope")
    b.load_state_dict(a.state_dict())
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        ya, yb = a(x, positions=POSITIONS), b(x, positions=POSITIONS)
    assert float((ya - yb).abs().max() / ya.abs().max()) > 1e-2


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_rotary_mhe_never_takes_the_folded_path(kind):
    mod = make(kind)
    assert not mod.foldable
    for fold in (fold_mhe, lambda m: m.folded_query()):
        with pytest.raises(MheError, match="rotary"):
            fold(mod)
    holder = torch.nn.Sequential(mod)
    assert fold_model(holder)[0] is mod  # left as it is
    view = inference_view(holder)
    assert isinstance(view[0], type(mod)) and view[0].cache_heads == 1
    # the weight query fold is never used under rotary positions: the default equals the activation fold
    act = make(kind, query_fold="activation")
    act.load_state_dict(mod.state_dict())
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    torch.testing.assert_close(mod(x, positions=POSITIONS), act(x, positions=POSITIONS), rtol=0, atol=0)
    plain = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, causal=True).double()
    assert plain.foldable and fold_mhe(plain).kind == "mqa"  # without rotary positions it still folds


@pytest.mark.parametrize("kind", ROTARY_KINDS + ["mhe-mul psi-then-rope"])
def test_cached_decode_equals_the_full_forward(kind):
    """Token by token through the static cache, positions from the cache, as the prompt at once."""
    name, _, order = kind.partition(" ")
    mod = make(name, **({"rope_order": order} if order else {}))
    x = torch.randn(B, T, D_MODEL, dtype=torch.float64)
    with torch.no_grad():
        want = mod(x)  # positions default to 0 .. T-1
        cache = mod.new_cache(B, T + 2)
        steps = [mod(x[:, :3], cache=cache)] + [mod(x[:, t:t + 1], cache=cache) for t in range(3, T)]
    torch.testing.assert_close(torch.cat(steps, 1), want, **TOL)


@pytest.mark.parametrize("kind", ["fnet", "linear"])
def test_mixing_kinds_refuse_rotary_positions(kind):
    mod = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, max_len=16) if kind == "linear" \
        else build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS)
    with pytest.raises(MheError) as e:
        mod.attach_rotary(RotaryEmbedding(HEAD_DIM, max_len=16))
    assert "\n" not in str(e.value) and kind in str(e.value)


def test_mhe_muls_training_factors_as_a_matrix_product_are_the_elementwise_products():
    """``mhe._scaled_heads`` (MHE-Mul's per-head factors under autograd, one matrix product with a
    block-diagonal matrix): every output is a single product, so it equals ``a * f`` exactly in
    float64, and its gradients equal the elementwise form's to float64 rounding (sums in another order)."""
    from mhe.attention.mhe import _scaled_heads

    g = torch.Generator().manual_seed(7)
    a = torch.randn(2, 5, 1, 8, dtype=torch.float64, generator=g, requires_grad=True)
    f = torch.randn(3, 8, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(2, 5, 3, 8, dtype=torch.float64, generator=g)
    got, want = _scaled_heads(a, f), a * f
    assert got.shape == (2, 5, 3, 8) and torch.equal(got, want)
    for x, y in zip(torch.autograd.grad((got * w).sum(), (a, f)), torch.autograd.grad((want * w).sum(), (a, f))):
        torch.testing.assert_close(x, y, rtol=1e-14, atol=1e-14)


def test_mhe_muls_training_factors_round_once_under_bf16_autocast():
    """Under bf16 autocast ``_scaled_heads`` keeps the float32 factors (two bf16 terms in the one
    product): its queries are ``a * f`` computed with float32 factors and rounded once to bf16, as the
    elementwise form gives them, but for the rare double rounding (under 1% of the entries, at most
    one bf16 step apart). Rounding the factors to bf16 first differs in about a quarter of them."""
    from mhe.attention.mhe import _scaled_heads

    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, 64, 1, 64, generator=g).to(torch.bfloat16)
    f = 1 + 0.03 * torch.randn(9, 64, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _scaled_heads(a, f)
    want = (a.float() * f).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert float((got != want).float().mean()) < 0.01
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=0)
