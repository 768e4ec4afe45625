"""Fewer kernels per decode step, same function: Q, K and V in one product, and a gated
feed-forward's gate and up in one (fused_projections), one additive mask per forward for SDPA
(AttentionMask.for_kernel), cum_seq_q built once."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhe.attention import Attention, AttentionMask, masks
from mhe.attention.folding import inference_view, shared_copy
from mhe.attention.fused_projections import fuse_projections, fused_projection
from mhe.models import build_model
from mhe.models.layers import SwiGLU

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)
FUSING = [("tiny-decoder", k) for k in ("mha", "mqa", "gqa", "mhe-mul", "mhe-add")] + \
    [("llama-tiny", k) for k in ("mha", "gqa", "mhe-mul", "mhe-add")]


def small(name, kind):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    model = build_model(name, attention=kind, attn_options=opts, **SMALL).double().eval()
    with torch.no_grad():  # MHE head embeddings far from zero; biases that are not zero
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.1)
    return model


def fused_view(model):
    return fuse_projections(shared_copy(inference_view(model)))


@pytest.mark.parametrize("name,kind", FUSING)
def test_fused_view_computes_the_model_prefill_and_decode_steps(name, kind):
    """float64: the prompt, then two cached one-token steps, equal the model's own to 1e-12."""
    torch.manual_seed(0)
    model = small(name, kind)
    view = fused_view(model)
    fused = [m for m in view.modules() if fused_projection(m) is not None]
    assert sum(isinstance(m, Attention) for m in fused) == SMALL["n_layers"]
    assert sum(isinstance(m, SwiGLU) for m in fused) == (SMALL["n_layers"] if name == "llama-tiny" else 0)
    ids = torch.randint(3, 99, (2, 9))
    want, got = model.new_caches(2, 12), view.new_caches(2, 12)
    for part in (ids[:, :7], ids[:, 7:8], ids[:, 8:9]):
        a = model(part, caches=want).logits
        b = view(part, caches=got).logits
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    assert fused_projection(next(m for m in model.modules() if hasattr(m, "q_proj"))) is None  # the model is untouched


@pytest.mark.parametrize("kind", ["skv", "el-att", "sha"])
def test_kinds_without_three_projections_of_x_are_left_as_they_are(kind):
    view = fused_view(small("tiny-decoder", kind))
    assert not any(fused_projection(m) is not None for m in view.modules())


def test_literal_mhe_is_not_fused():
    model = build_model("llama-tiny", attention="mhe-mul", attn_options={"rope_order": "psi-then-rope"}, **SMALL)
    view = fuse_projections(shared_copy(model))
    assert not any(fused_projection(m) is not None for m in view.modules() if isinstance(m, Attention))


class _MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.n += 1
        return func(*args, **(kwargs or {}))


def _matmuls(model, ids, new):
    with _MatmulCount() as count:
        model.generate(ids, new, step_mode="eager")
    return count.n


@pytest.mark.parametrize("name", ["tiny-decoder", "llama-tiny"])
@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
def test_generation_runs_one_projection_product_a_layer(kind, name):
    """A generated token's matrix products: per layer one for Q, K and V, the output projection and
    two for the MLP (GELU: in and out; SwiGLU: gate and up in one, then down), then the LM head
    (attention itself runs in SDPA); unfused it was 6 a layer (7 with SwiGLU)."""
    torch.manual_seed(0)
    model = small(name, kind)
    ids = torch.randint(3, 99, (1, 5))
    per_token = _matmuls(model, ids, 4) - _matmuls(model, ids, 3)
    assert per_token == 4 * SMALL["n_layers"] + 1


def test_changed_weights_reach_the_fused_copy():
    """The stacked copy does not follow the model, so the session rebuilds its view: generation
    after an in-place update equals a fresh model's."""
    torch.manual_seed(0)
    model = small("tiny-decoder", "mha")
    ids = torch.randint(3, 99, (1, 5))
    session = model.generator(1, 12)
    model.generate(ids, 4, session=session, return_logits=True, return_dict=True)
    with torch.no_grad():
        for layer in model.decoder.layers:
            layer.self_attn.k_proj.weight.mul_(-1.5)
    got = model.generate(ids, 4, session=session, return_logits=True, return_dict=True).logits
    fresh = small("tiny-decoder", "mha")
    fresh.load_state_dict(model.state_dict())
    want = fresh.generate(ids, 4, return_logits=True, return_dict=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_additive_mask_is_built_once_and_equals_sdpas_own():
    key_mask = torch.tensor([[False, True, True, True, True, True], [True] * 6])
    mask = masks.self_attention_mask(torch.zeros(2, 1, dtype=torch.long), key_mask, start=torch.tensor(4), keys=6)
    assert isinstance(mask, AttentionMask) and mask.dense.dtype == torch.bool
    first = mask.for_kernel("sdpa", torch.float64)
    assert mask.for_kernel("sdpa", torch.float64) is first  # one conversion for every layer
    assert torch.equal(first == 0, mask.dense) and torch.isinf(first[~mask.dense.expand_as(first)]).all()
    assert mask.for_kernel("eager", torch.float64) is mask.dense  # kernels that read booleans get booleans
    q, k = torch.randn(2, 4, 1, 8, dtype=torch.float64), torch.randn(2, 4, 6, 8, dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(sdpa(q, k, k, attn_mask=first), sdpa(q, k, k, attn_mask=mask.dense))


def test_compiled_additive_mask_is_one_operator_with_aligned_rows():
    dense = torch.rand(2, 1, 3, 13) > 0.4  # 13 keys: rows padded to 16 inside compile
    eager = masks.additive_mask(dense, torch.bfloat16)
    compiled = torch.compile(lambda d: masks.additive_mask(d, torch.bfloat16), fullgraph=True)(dense)
    assert torch.equal(compiled, eager) and torch.equal(eager == 0, dense)
    op = torch.ops.mhe.additive_mask(dense, torch.bfloat16)
    assert torch.equal(op, eager) and op.stride() == (48, 48, 16, 1)
    torch.library.opcheck(torch.ops.mhe.additive_mask.default, (dense, torch.float32))
    graph = []
    torch.compile(lambda d: masks.additive_mask(d, torch.float32),
                  backend=lambda gm, _: graph.append(gm) or gm.forward)(dense)
    assert [n.target for n in graph[0].graph.nodes if n.op == "call_function"] == [torch.ops.mhe.additive_mask]


def test_a_large_gated_feed_forward_keeps_two_products():
    """Gate and up are stacked only while each is at most ``FUSE_MAX_BYTES`` (a one-row product
    bound by its launch); a larger pair keeps its two products and gets no stacked copy."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from mhe.models.layers import FUSE_MAX_BYTES

    def ffn(d_ff):
        return SwiGLU(SimpleNamespace(d_model=64, d_ff=d_ff, dropout=0.0))

    assert fused_projection(fuse_projections(ffn(FUSE_MAX_BYTES // (64 * 4)))) is not None  # float32: just fits
    large = fuse_projections(ffn(FUSE_MAX_BYTES // (64 * 4) + 1))  # one row more
    assert fused_projection(large) is None
    x = torch.randn(2, 3, 64)
    assert torch.equal(large(x), large.down(F.silu(large.gate(x)) * large.up(x)))


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_a_rotary_mhe_view_keeps_its_folded_tensors_made_once(kind, monkeypatch):
    """Under rotary positions the fused view keeps what it would otherwise build from the head
    embeddings at every step: the per-head query factors (or offsets) and the folded output
    weight and bias. Each equals the module's own, is outside the state dict and absent from the
    model, and a decode step builds none of them again (a step that called ``_query_factors`` or
    ``folded_output`` would fail here). MHE-Add's output weight is W^O's own tensor, not a copy."""
    from mhe.attention.fused_projections import fused_factors, fused_output
    from mhe.attention.mhe import _MHEBase

    torch.manual_seed(0)
    model = small("llama-tiny", kind)
    view = fused_view(model)
    mods = [m for m in view.modules() if isinstance(m, _MHEBase)]
    assert len(mods) == SMALL["n_layers"]
    for m in mods:
        assert torch.equal(fused_factors(m), m._query_factors())
        (w, b), (want_w, want_b) = fused_output(m), m.folded_output()
        assert torch.equal(w, want_w)
        assert (b is None and want_b is None) or torch.equal(b, want_b)
        assert (w.data_ptr() == m.out_proj.weight.data_ptr()) == (kind == "mhe-add")
        for kept in (fused_factors(m), w, b):  # plain tensors: a deep copy of the view works
            assert kept is None or (kept.is_leaf and not kept.requires_grad)
    assert not any("fused_query_factors" in k or "fused_out" in k for k in view.state_dict())
    assert all(fused_factors(m) is None and fused_output(m) is None
               for m in model.modules() if isinstance(m, _MHEBase))
    ids = torch.randint(3, 99, (2, 6))
    want = model(ids).logits
    monkeypatch.setattr(_MHEBase, "_query_factors", lambda self: pytest.fail("factors built again in a step"))
    monkeypatch.setattr(type(mods[0]), "folded_output", lambda self: pytest.fail("output folded again in a step"))
    torch.testing.assert_close(view(ids).logits, want, rtol=0, atol=1e-12)


def test_folded_and_literal_mhe_views_keep_no_factors():
    """Folded MHE (no rotary positions) has no factors left in its view, and psi-then-rope
    computes its heads literally: neither keeps any."""
    from mhe.attention.fused_projections import fused_factors, fused_output

    for name, opts in (("tiny-decoder", {}), ("llama-tiny", {"rope_order": "psi-then-rope"})):
        model = build_model(name, attention="mhe-mul", attn_options=opts, **SMALL)
        view = fuse_projections(shared_copy(inference_view(model)))
        assert not any(fused_factors(m) is not None or fused_output(m) is not None for m in view.modules())


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_changed_weights_reach_the_kept_tensors(kind):
    """The kept factors and output do not follow the model, so the session rebuilds its view when
    the head embeddings or W^O change in place: generation then equals a fresh model's."""
    torch.manual_seed(0)
    model = small("llama-tiny", kind)
    ids = torch.randint(3, 99, (1, 5))
    session = model.generator(1, 12)
    model.generate(ids, 4, session=session, return_logits=True, return_dict=True)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.mul_(-2.0)
                m.out_proj.weight.add_(0.1)
    got = model.generate(ids, 4, session=session, return_logits=True, return_dict=True).logits
    fresh = small("llama-tiny", kind)
    fresh.load_state_dict(model.state_dict())
    want = fresh.generate(ids, 4, return_logits=True, return_dict=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"),
                    reason="torch before 2.9 has no per-backend fp32 setting")
@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_kept_tensors_are_made_under_torchs_per_backend_precision_setting(kind):
    """A caller who set float32 matrix products through torch's per-backend setting (with which
    reading the process-wide one raises) still decodes rotary MHE, to the same logits as without
    the setting (on a CPU it changes no product)."""
    torch.manual_seed(0)
    model = small("llama-tiny", kind).float()
    ids = torch.randint(3, 99, (1, 5))
    want = model.generate(ids, 4, session=model.generator(1, 12), return_logits=True, return_dict=True).logits
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        got = model.generate(ids, 4, session=model.generator(1, 12), return_logits=True, return_dict=True).logits
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_kept_tensors_are_exact_whatever_the_first_call_ran_under(kind):
    """A session first used under bf16 autocast keeps float32 tensors made exactly (MHE-Add's
    bias is a product, which autocast would have made bf16): a later float32 call equals a fresh
    session's."""
    torch.manual_seed(0)
    model = small("llama-tiny", kind).float()
    ids = torch.randint(3, 99, (1, 5))
    session = model.generator(1, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.generate(ids, 2, session=session)
    got = model.generate(ids, 4, session=session, return_logits=True, return_dict=True).logits
    want = model.generate(ids, 4, session=model.generator(1, 12), return_logits=True, return_dict=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
