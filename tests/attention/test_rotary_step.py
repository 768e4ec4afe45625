"""The rotating step (``mhe.attention.rotary_step``, ``kv_cache.ROTARY_STEP``): a decode step's
queries and keys rotated and its keys stacked with its values by one kernel, against the rotary
embedding and ``torch.stack`` it replaces (Triton's interpreter on CPU tensors, float64 and
float32), through ``model.generate`` for every kind whose session view has one fused Q/K/V
product, as one operator a layer inside a compiled step, and its fallback and refusals."""

import pytest
import torch

from mhe.attention import kv_cache, rotary_step, triton_decode
from mhe.attention.rotary import RotaryEmbedding
from mhe.models import build_model

needs_triton = pytest.mark.skipif(rotary_step.triton is None, reason="Triton is not installed (the interpreter "
                                  "runs its kernel on a CPU)")


@pytest.fixture
def interpret():
    if not triton_decode.interpreting():
        pytest.skip("Triton's interpreter is on only without a GPU (TRITON_INTERPRET=1 before importing triton)")


SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)
STEP_KINDS = [("mha", {}, True), ("gqa", {"n_kv_heads": 2}, True), ("mqa", {}, True), ("skv", {}, False),
              ("el-att", {}, False), ("mhe-mul", {}, True), ("mhe-add", {}, True),
              ("mhe-mul", {"rope_order": "psi-then-rope"}, False), ("mhe-mul", {"impl": "reference"}, False)]
"""(kind, options, whether its steps take the kernel): the kinds whose session view has one fused
Q/K/V product, MHE's fast path among them (its shared query rotated, the heads' factors in the
attention kernel); SKV and EL-att make their keys otherwise, and MHE's literal forms make their
heads before the rotation."""


@needs_triton
@pytest.mark.parametrize("kind,opts,uses", STEP_KINDS)
def test_generation_through_the_kernel_equals_the_unfused_path(interpret, kind, opts, uses, monkeypatch):
    """``model.generate`` on a Llama-style decoder in float64, ragged left-padded prompts: with
    ``ROTARY_STEP`` every step of MHA, GQA, MQA and MHE's fast path goes through the rotating step
    (2 layers x 4 steps), and the logits equal the unfused path's to 1e-12."""
    torch.manual_seed(0)
    model = build_model("llama-tiny", attention=kind, attn_options=opts or None, **SMALL).double().eval()
    ids = torch.randint(3, 99, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :5] = 0
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # the unfused path, whatever the default
    want, lw = model.generate(ids, 5, attention_mask=mask, return_logits=True)
    launches, launch = [], rotary_step.launch_step
    monkeypatch.setattr(rotary_step, "launch_step", lambda *a: launches.append(1) or launch(*a))
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", True)
    got, lg = model.generate(ids, 5, attention_mask=mask, session=model.generator(3, 12), return_logits=True)
    assert len(launches) == (2 * 4 if uses else 0)
    torch.testing.assert_close(lg, lw, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, want)


@needs_triton
def test_a_compiled_step_holds_one_operator_a_layer(interpret, monkeypatch):
    """Inside ``torch.compile`` the rotating step is ``mhe::rotary_step``, one a layer taking the
    fused product whole, and the cache's one ``index_copy`` of its stack, with the eager logits
    (float64)."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch.manual_seed(2)
    model = build_model("llama-tiny", attention="gqa", attn_options={"n_kv_heads": 2}, **SMALL).double().eval()
    ids = torch.randint(3, 99, (2, 6))
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # the unfused path, whatever the default
    want, lw = model.generate(ids, 4, return_logits=True)
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", True)
    torch._dynamo.reset()
    session = model.generator(2, 12, step_mode="compile", compile_options={"backend": recording})
    got, lg = model.generate(ids, 4, session=session, return_logits=True)
    torch._dynamo.reset()
    steps = [[str(n.target) for n in g.graph.nodes if n.op in ("call_function", "call_method")] for g in graphs]
    steps = [calls for calls in steps if any("rotary_step" in c for c in calls)]  # not the token choice
    assert len(steps) == 1 and sum("rotary_step" in c for c in steps[0]) == SMALL["n_layers"]
    assert sum("index_copy" in c for c in steps[0]) == SMALL["n_layers"]
    firsts = [n.args[0] for g in graphs for n in g.graph.nodes if "rotary_step" in str(n.target)]
    assert len(firsts) == SMALL["n_layers"] and all("linear" in str(a.target) for a in firsts)  # not views
    torch.testing.assert_close(lg, lw, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, want)


def test_switching_the_step_rebuilds_a_held_sessions_steps(monkeypatch):
    """A session's captured steps keep what they were captured with, so ``ROTARY_STEP`` is part of
    what its view is built for: switching it makes a new view (and new steps) at the next call."""
    torch.manual_seed(3)
    model = build_model("llama-tiny", attention="mqa", **SMALL).eval()
    ids = torch.randint(3, 99, (2, 5))
    session = model.generator(2, 12)
    model.generate(ids, 3, session=session)
    before = session.view
    model.generate(ids, 3, session=session)
    assert session.view is before  # same weights, same setting: kept
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", not kv_cache.ROTARY_STEP)
    model.generate(ids, 3, session=session)
    assert session.view is not before


def apart_step(b, n, g, d, dtype):
    """Queries, keys and values from three buffers, each with strides of its own (views into longer
    tensors): the kernel reads any strides with the last one 1."""
    q = torch.randn(b, 1, n * d, dtype=dtype).view(b, 1, n, d).transpose(1, 2)
    k = torch.randn(b, g + 1, 3, d, dtype=dtype)[:, 1:, 2:]
    v = torch.randn(b, 2 * g, 5, d, dtype=dtype)[:, ::2, 3:4]
    return q, k, v


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("n,g", [(6, 2), (4, 4), (3, 1)])
@pytest.mark.parametrize("made", ["product", "apart"])
def test_the_step_kernel_rotates_queries_and_keys_and_stacks_the_values(interpret, dtype, tol, fraction, n, g, made):
    """Rows at different positions, a partly rotated head, the inputs a fused Q/K/V product
    (``rotate_step``, which splits it) or three tensors of strides of their own (``launch_step``):
    the queries equal the embedding's, the stack equals ``stack((rotary(k), v))``."""
    torch.manual_seed(0)
    rotary = RotaryEmbedding(16, fraction=fraction, max_len=64)
    positions = torch.tensor([[5], [0], [37]])
    if made == "product":
        qkv = torch.randn(3, 1, (n + 2 * g) * 16, dtype=dtype)
        q, k, v = rotary_step.split_product(qkv, n, g)
        assert rotary_step.step_fast_path(qkv, n, g, positions)
        got_q, got_kv = rotary_step.rotate_step(qkv, n, g, rotary, positions)
    else:
        q, k, v = apart_step(3, n, g, 16, dtype)
        got_q, got_kv = rotary_step.launch_step(q, k, v, *rotary.table(q.device), positions)
    torch.testing.assert_close(got_q, rotary(q, positions), rtol=tol, atol=tol)
    torch.testing.assert_close(got_kv, torch.stack((rotary(k, positions), v)), rtol=tol, atol=tol)
    assert got_q.is_contiguous() and got_kv.shape == (2, 3, g, 1, 16) and torch.equal(got_kv[1], v)


@pytest.mark.parametrize("kind,opts,heads,kv_heads", [("mha", {}, 4, 4), ("gqa", {"n_kv_heads": 2}, 4, 2),
                                                       ("mqa", {}, 4, 1), ("mhe-mul", {}, 1, 1)])
def test_the_product_splits_as_the_sublayers_split_it(kind, opts, heads, kv_heads):
    """``split_product`` of a fused view's ``_step_product`` gives the view's own unrotated queries
    (MHE: its shared query), keys and values, as its split and heads make them."""
    from mhe.attention import kernels
    from mhe.attention.base import attention_sublayers
    from mhe.attention.fused_projections import fuse_projections

    torch.manual_seed(5)
    model = build_model("llama-tiny", attention=kind, attn_options=opts or None, **SMALL).eval()
    attn = attention_sublayers(fuse_projections(model))[0]
    x = torch.randn(2, 1, SMALL["d_model"])
    with torch.no_grad():
        qkv, h, g = attn._step_product(x)
        want = list(attn._self_projections(x, None))
    if isinstance(want[0], kernels.FactoredQuery):
        want[0] = want[0].shared
    assert (h, g) == (heads, kv_heads) and qkv.shape == (2, 1, (heads + 2 * kv_heads) * 8)
    for got, made in zip(rotary_step.split_product(qkv, h, g), want):
        assert torch.equal(got, made)


@needs_triton
def test_the_step_refuses_what_its_kernel_does_not_take(interpret):
    """Two new positions, positions of another shape, a product whose width is no multiple of its
    heads, or one that records autograd: the step rotates with the embedding instead."""
    qkv = torch.randn(2, 1, (4 + 2 * 2) * 8)
    pos = torch.zeros(2, 1, dtype=torch.long)
    assert rotary_step.step_fast_path(qkv, 4, 2, pos)
    assert not rotary_step.step_fast_path(torch.randn(2, 2, (4 + 2 * 2) * 8), 4, 2, pos)
    assert not rotary_step.step_fast_path(qkv, 4, 2, pos[:, 0])
    assert not rotary_step.step_fast_path(qkv[..., :-1], 4, 2, pos)
    assert not rotary_step.step_fast_path(qkv.clone().requires_grad_(), 4, 2, pos)


def test_the_rotating_step_without_its_kernel_gives_the_same_numbers(monkeypatch):
    """Outside Triton's interpreter on CPU tensors the step rotates with the embedding and stacks
    with ``torch.stack``: a session of the default path's logits, bit for bit."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(1)
    model = build_model("llama-tiny", attention="gqa", attn_options={"n_kv_heads": 2}, **SMALL).double().eval()
    ids = torch.randint(3, 99, (2, 6))
    qkv = torch.randn(2, 1, (4 + 2 * 2) * 8, dtype=torch.float64)
    assert not rotary_step.step_fast_path(qkv, 4, 2, torch.zeros(2, 1, dtype=torch.long))
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # the default path, whatever the default
    want, lw = model.generate(ids, 4, session=model.generator(2, 12), return_logits=True)
    splits, split = [], rotary_step.split_product
    monkeypatch.setattr(rotary_step, "split_product", lambda *a: splits.append(1) or split(*a))
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", True)
    got, lg = model.generate(ids, 4, session=model.generator(2, 12), return_logits=True)
    assert len(splits) == SMALL["n_layers"] * 3  # every decode step took the rotating step's fallback
    assert torch.equal(lg, lw) and torch.equal(got, want)


@needs_triton
@pytest.mark.parametrize("kind,opts", [("gqa", {"n_kv_heads": 2}), ("mqa", {})])
def test_the_unfused_model_keeps_its_step(interpret, kind, opts, monkeypatch):
    """The model itself (its Q, K and V products apart, not a session's fused view), stepped with
    caches in float64: with ``ROTARY_STEP`` it has no fused product to hand the kernel, so each
    step's logits are the default path's, bit for bit, and the kernel never runs."""
    torch.manual_seed(4)
    model = build_model("llama-tiny", attention=kind, attn_options=opts or None, **SMALL).double().eval()
    ids = torch.randint(3, 99, (2, 7))
    launches, launch = [], rotary_step.launch_step
    monkeypatch.setattr(rotary_step, "launch_step", lambda *a: launches.append(1) or launch(*a))
    logits = {}
    for on in (False, True):
        monkeypatch.setattr(kv_cache, "ROTARY_STEP", on)
        caches = model.new_caches(2, 12)
        with torch.no_grad():
            logits[on] = [model(ids[:, :5], caches=caches).logits]
            logits[on] += [model(ids[:, t:t + 1], caches=caches).logits for t in (5, 6)]
    assert not launches
    for got, want in zip(logits[True], logits[False]):
        assert torch.equal(got, want)
