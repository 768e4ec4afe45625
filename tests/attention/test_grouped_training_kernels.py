"""The Llama-style training step's attention calls: one unmasked causal SDPA call per layer with the
heads laid out as the projections give them, grouped K/V heads kept off cuDNN under autograd, and
both changes leave the function as it was (float64, bit for bit)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from conftest import B, D_MODEL, N_HEADS, T, VOCAB
from mhe.attention import kernels, masks
from mhe.attention.mhe import _MHEBase
from mhe.models import build_model

LLAMA = dict(vocab_size=VOCAB, d_model=D_MODEL, n_heads=N_HEADS, n_layers=2, d_ff=64, max_len=64)
KINDS = ("mha", "gqa", "mqa", "mhe-mul", "mhe-add")


def _llama(kind: str) -> torch.nn.Module:
    opts = {"attn_options": {"n_kv_heads": 2}} if kind == "gqa" else {}
    return build_model("llama-tiny", attention=kind, **LLAMA, **opts).double()


def _recorded_calls(model, ids, monkeypatch, *, grad=True) -> list[dict]:
    """The keywords, layouts and CUDA backends of every SDPA call of one forward (and backward)."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def record(q, k, v, **kw):
        calls.append(dict(kw, q=q, k=k, v=v, cuda_backends=kernels.sdpa_backends(q, k, v, kw, device_type="cuda")))
        return sdpa(q, k, v, **kw)
    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    with torch.set_grad_enabled(grad):
        loss = model(ids, labels=ids).loss
        if grad:
            loss.backward()
    return calls


def _bshd(t: torch.Tensor) -> bool:
    """``[B, h, T, d]`` laid out ``[B, T, h, d]``: the split projection's own layout."""
    return t.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("kind", KINDS)
def test_llama_training_attention_is_one_unmasked_causal_call_per_layer(kind, monkeypatch):
    model = _llama(kind).train()
    ids = torch.randint(0, VOCAB, (B, T))
    calls = _recorded_calls(model, ids, monkeypatch)
    assert len(calls) == LLAMA["n_layers"]
    grouped = kind != "mha"
    for c in calls:
        assert c["attn_mask"] is None and c["is_causal"] is True and c["dropout_p"] == 0.0
        assert c["enable_gqa"] is grouped and (c["k"].shape[1] < c["q"].shape[1]) is grouped
        assert _bshd(c["q"])  # MHE's per-head factors included: laid out as MQA's query
        assert all(t.stride(-1) == 1 for t in (c["k"], c["v"]))
        backends = c["cuda_backends"]
        if grouped:  # on a GPU: off cuDNN, on FlashAttention
            assert backends is not None and SDPBackend.CUDNN_ATTENTION not in backends
            assert backends[0] == SDPBackend.FLASH_ATTENTION
        else:
            assert backends is None  # MHA: SDPA's own choice


@pytest.mark.parametrize("kind", ("gqa", "mhe-mul"))
def test_grouped_calls_without_autograd_keep_sdpas_choice(kind, monkeypatch):
    calls = _recorded_calls(_llama(kind).eval(), torch.randint(0, VOCAB, (B, T)), monkeypatch, grad=False)
    assert calls and all(c["cuda_backends"] is None for c in calls)


def test_the_grouped_rule_applies_only_where_flash_attention_takes_the_call(monkeypatch):
    rule = kernels.grouped_grad_backends
    on = dict(grouped=True, grad=True, masked=False, square=True)
    assert rule("cuda", **on) is kernels.EXACT_DROPOUT_BACKENDS
    assert SDPBackend.CUDNN_ATTENTION not in rule("cuda", **on)
    assert rule("cpu", **on) is None
    for name in on:  # ungrouped, no autograd, a mask, causal over more keys than queries: SDPA's choice
        assert rule("cuda", **{**on, name: not on[name]}) is None
    monkeypatch.setattr(kernels, "GROUPED_GRAD_OFF_CUDNN", False)
    assert rule("cuda", **on) is None


@pytest.mark.parametrize("kind", ("gqa", "mqa", "mhe-mul"))
def test_the_backend_restriction_changes_nothing_and_compiles_in_one_graph(kind, monkeypatch):
    """Forced on a CPU (where it changes no backend): the same loss and gradients, bit for bit, and
    dynamo traces the restriction without a graph break."""
    model = _llama(kind).train()
    ids = torch.randint(0, VOCAB, (B, T))

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]
    free = loss_and_grads()
    monkeypatch.setattr(kernels, "grouped_grad_backends", lambda *a, **k: kernels.EXACT_DROPOUT_BACKENDS)
    forced = loss_and_grads()
    assert len(free) == len(forced) and all(torch.equal(a, b) for a, b in zip(free, forced))
    explained = torch._dynamo.explain(model)(ids, labels=ids)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("kind", ("mhe-mul", "mhe-add"))
def test_rotary_mhe_queries_in_the_projection_layout_are_the_same_numbers(kind, monkeypatch):
    """The per-head factors applied in the ``[B, T, n, d]`` layout: the loss and every gradient
    equal those of the factors applied to ``[B, 1, T, d]`` directly (as before): bit for bit for
    MHE-Add, and for MHE-Mul, whose training factors are a matrix product (``mhe._scaled_heads``:
    the backward's sums in another order), to float64 rounding."""
    model = _llama(kind).train()
    ids = torch.randint(0, VOCAB, (B, T))

    def loss_and_grads():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in model.parameters()]
    now = loss_and_grads()

    def before(self, a, f):
        f = f[:, None, :]  # [n, 1, d]
        return a * f if self.multiplicative else a + f
    monkeypatch.setattr(_MHEBase, "_psi_factor", before)
    was = loss_and_grads()
    if kind == "mhe-add":
        assert all(torch.equal(a, b) for a, b in zip(now, was))
    for a, b in zip(now, was):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13 * float(b.abs().max()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ("gqa", "mqa", "mhe-mul"))
def test_grouped_training_attention_runs_on_flash_attention_on_a_gpu(kind):
    from mhe.bench.profiling import sdpa_calls

    model = build_model("llama-tiny", attention=kind, **{**LLAMA, "d_model": 256},
                        **({"attn_options": {"n_kv_heads": 2}} if kind == "gqa" else {})).cuda().train()
    ids = torch.randint(0, VOCAB, (B, 64), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.profiler.profile() as prof:
        model(ids, labels=ids).loss.backward()
    assert sdpa_calls(prof, 1) == f"flash {LLAMA['n_layers']} fwd / {LLAMA['n_layers']} bwd"


# --- native grouped heads against the literal equations (issue 42) ---------------------------------

def _grouped_inputs(n=4, g=2, t=6, s=6, d=8):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, h, L, d, generator=gen, dtype=torch.float64, requires_grad=True)
               for h, L in ((n, t), (g, s), (g, s)))
    return q, k, v


def _literal(q, k, v, *, causal, key_mask=None):
    """Head by head, query head i over K/V head i // (n / g), the softmax written out (tests/reference.py)."""
    from reference import softmax_attention

    n, g = q.shape[1], k.shape[1]
    heads = [softmax_attention(q[:, i], k[:, i // (n // g)], v[:, i // (n // g)], causal=causal, key_mask=key_mask)
             for i in range(n)]
    return torch.stack(heads, 1)  # [B, n, T, d]


def _out_and_grads(fn, q, k, v):
    out = fn(q, k, v)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
    grads = torch.autograd.grad((out * weights).sum(),
                                (q, k, v))
    return [out.detach(), *grads]


@pytest.mark.parametrize("expand", (False, True), ids=("native", "repeated"))
@pytest.mark.parametrize("masked", (False, True), ids=("causal", "causal+padding"))
@pytest.mark.parametrize("g", (1, 2))
def test_grouped_sdpa_equals_the_literal_equations_forward_and_gradients(g, masked, expand, monkeypatch):
    """The sdpa kernel over g < n K/V heads, read natively (``enable_gqa``) or repeated where no fused
    backend would read them (the rule forced), equals the per-head softmax in float64: the output
    and the gradients of q, k and v (each K/V head's gradient summed over its group)."""
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda q, k, v, **kw: calls.append((k.shape[1], kw))
                        or sdpa(q, k, v, **kw))
    if expand:
        monkeypatch.setattr(kernels, "grouped_natively", lambda *a, **kw: False)
    q, k, v = _grouped_inputs(g=g)
    key_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2]) if masked else None
    got = _out_and_grads(lambda q, k, v: kernels.attend(q, k, v, masks.self_attention_mask(q[:, 0], key_mask)), q, k, v)
    want = _out_and_grads(lambda q, k, v: _literal(q, k, v, causal=True, key_mask=key_mask), q, k, v)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert len(calls) == 1
    heads, kw = calls[0]
    assert heads == (4 if expand else g) and kw["enable_gqa"] is not expand


def test_grouped_heads_are_repeated_only_where_no_fused_backend_reads_them(monkeypatch):
    monkeypatch.setattr(kernels, "MEM_EFFICIENT_GQA", False)
    rule = kernels.grouped_natively
    q = torch.zeros(1, 4, 8, 64, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 8, 64, dtype=torch.bfloat16)
    flash = dict(attn_mask=None, is_causal=True, enable_gqa=True)
    assert rule(q, k, flash, "cuda")
    assert rule(q, q, flash, "cuda") and rule(q, k, {**flash, "attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "cpu")
    assert not rule(q, k, {**flash, "attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "cuda")  # FlashAttention: no mask
    assert not rule(q.float(), k.float(), flash, "cuda")  # FlashAttention: fp16/bf16 only
    assert not rule(torch.zeros(1, 4, 8, 512, dtype=torch.bfloat16), torch.zeros(1, 2, 8, 512, dtype=torch.bfloat16),
                    flash, "cuda")  # head_dim over 256
    assert not rule(q[:, :, :2], k, flash, "cuda") and rule(q[:, :, :2], k, {**flash, "is_causal": False}, "cuda")
    # under bf16 autocast SDPA casts a float32 query (MHE-Mul's, after its float32 head factors)
    # before it picks a backend: FlashAttention reads it natively (no card here: autocast stubbed)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda device=None: device == "cuda")
    monkeypatch.setattr(torch, "get_autocast_dtype", lambda device: torch.bfloat16)
    assert rule(q.float(), k, flash, "cuda")
    monkeypatch.setattr(kernels, "MEM_EFFICIENT_GQA", True)
    assert rule(q.float(), k.float(), {**flash, "attn_mask": torch.ones(8, 8, dtype=torch.bool)}, "cuda")


def _loss_curve(kind: str, kernel: str, steps: int = 6) -> list[float]:
    from mhe.attention.base import set_kernel

    torch.manual_seed(0)
    model = set_kernel(_llama(kind), kernel).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(2))  # one batch, learnt
    curve = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        curve.append(loss.item())
    return curve


@pytest.mark.parametrize("kind", ("gqa", "mqa", "mhe-mul"))
def test_a_tiny_training_run_has_the_expanded_kernels_loss_curve(kind, monkeypatch):
    """Six AdamW steps in float64: native grouped heads, and heads repeated by the fallback rule, give
    the loss curve of the written-out softmax over K/V repeated per query head (``eager``) within rounding."""
    reference = _loss_curve(kind, "eager")
    native = _loss_curve(kind, "sdpa")
    monkeypatch.setattr(kernels, "grouped_natively", lambda *a, **kw: False)
    repeated = _loss_curve(kind, "sdpa")
    assert reference[-1] < reference[0] - 0.05  # it trains
    for curve in (native, repeated):
        assert curve == pytest.approx(reference, rel=1e-12, abs=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
def test_masked_grouped_training_attention_stays_off_the_math_backend_on_a_gpu(dtype):
    """A grouped call FlashAttention refuses (a padding mask; float32) runs on a fused backend, over
    repeated K/V heads where this torch's memory-efficient kernel does not read grouped ones, and
    equals the per-head softmax (computed in float64) in its output and gradients."""
    from mhe.bench.profiling import sdpa_calls

    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in _grouped_inputs(n=8, g=2, t=128, s=128, d=64))
    key_mask = torch.ones(B, 128, dtype=torch.bool, device="cuda")
    key_mask[1, 100:] = False
    with torch.profiler.profile() as prof:
        got = _out_and_grads(lambda q, k, v: kernels.attend(q, k, v, masks.self_attention_mask(q[:, 0], key_mask)), q, k, v)
    assert "math" not in sdpa_calls(prof, 1)
    ref = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    want = _out_and_grads(lambda q, k, v: _literal(q, k, v, causal=True, key_mask=key_mask.cpu()), *ref)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4  # bf16: 8 bits of mantissa; float32: TF32 off in SDPA
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double().cpu(), b, rtol=tol, atol=tol * float(b.abs().max()))


def test_long_grouped_training_calls_run_on_cudnn_over_their_grouped_heads_on_hopper_only():
    """The rule of ``cudnn_for_grad``: a CUDA call over grouped heads that autograd records, of at
    least CUDNN_GRAD_MIN_KEYS keys, on a card with cuDNN attention; nothing else. Such a call, when
    unmasked, may run on cuDNN (or FlashAttention), both reading the grouped heads natively; a shorter
    one on FlashAttention and the other exact backends, never cuDNN."""
    rule, n = kernels.cudnn_for_grad, kernels.CUDNN_GRAD_MIN_KEYS
    q = torch.zeros(1, 4, n, 8, requires_grad=True)
    k = torch.zeros(1, 2, n, 8)
    assert rule(q, k, device_type="cuda", cudnn=True)
    assert not rule(q, k, device_type="cuda", cudnn=False)  # no cuDNN attention (before Hopper)
    assert not rule(q, k, device_type="cpu", cudnn=True)
    assert not rule(q, k[:, :, :-1], device_type="cuda", cudnn=True)  # one key short
    assert not rule(q, q.detach(), device_type="cuda", cudnn=True)    # not grouped
    assert not rule(q.detach(), k, device_type="cuda", cudnn=True)    # nothing to differentiate
    with torch.no_grad():
        assert not rule(q, k, device_type="cuda", cudnn=True)         # inference
    call = dict(grouped=True, grad=True, masked=False, square=True)
    long = kernels.grouped_grad_backends("cuda", **call, long_on_cudnn=True)
    assert long == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    assert SDPBackend.CUDNN_ATTENTION not in kernels.grouped_grad_backends("cuda", **call)
    assert kernels.grouped_grad_backends("cuda", **{**call, "masked": True}, long_on_cudnn=True) is None
    # from a CPU tensor, what a CUDA card would run: the card is not asked, so FlashAttention's rule
    assert SDPBackend.CUDNN_ATTENTION not in kernels.sdpa_backends(q, k, k, {"enable_gqa": True}, device_type="cuda")


def test_grouped_calls_compile_in_one_graph_under_dynamic_shapes():
    """With the head counts symbolic (``dynamic=True``, as dynamo makes them once a second head count
    is seen), the sdpa kernel hands SDPA ``enable_gqa`` as a bool, which SDPA requires; the compiled
    call equals the eager one."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, h, 8, 16, generator=g) for h in (4, 2, 2))
    mask = masks.AttentionMask(causal=True)
    torch._dynamo.reset()
    fn = torch.compile(lambda q, k, v: kernels.attend(q, k, v, mask), dynamic=True, fullgraph=True, backend="eager")
    torch.testing.assert_close(fn(q, k, v), kernels.attend(q, k, v, mask), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("capability", ((9, 0), (8, 0)), ids=("hopper", "ampere"))
def test_the_card_query_of_the_rule_is_traced_as_a_constant(capability, monkeypatch):
    """``_cudnn_attention`` (what ``cudnn_for_grad`` asks of the card) compiles in one graph and
    answers as it does eagerly: dynamo cannot trace ``cudnn_sdp_enabled``, so without
    ``assume_constant_result`` every grouped training call of a compiled step broke its graph."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: True)
    cuda = torch.device("cuda")

    def step(q):
        return q * 2 if kernels._cudnn_attention(cuda) else q + 1
    q = torch.ones(3)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, fullgraph=True, backend="eager")(q), q * 2 if capability >= (9, 0) else q + 1)
    assert not kernels._cudnn_attention("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("g", (1, 2))
def test_long_grouped_training_calls_compile_in_one_graph_and_equal_the_equations_on_a_gpu(g, monkeypatch):
    """A grouped causal call of CUDNN_GRAD_MIN_KEYS keys under autograd (``cudnn_for_grad``'s
    length: cuDNN over the grouped heads on a Hopper card) is given to SDPA with its g K/V heads
    (nothing repeated), compiles in one graph (``fullgraph``), runs one fused SDPA call each way,
    and its output and gradients equal eager's and the per-head softmax computed in float64."""
    from mhe.bench.profiling import sdpa_calls

    n = kernels.CUDNN_GRAD_MIN_KEYS
    base = _grouped_inputs(n=4, g=g, t=n, s=n, d=64)
    mask = masks.self_attention_mask(torch.zeros(B, n, dtype=torch.long), None)

    def run(fn):
        q, k, v = (t.detach().to("cuda", torch.bfloat16).requires_grad_() for t in base)
        return _out_and_grads(fn, q, k, v)
    heads, sdpa = [], F.scaled_dot_product_attention

    def record(q, k, v, **kw):
        heads.append((k.shape[1], kw.get("enable_gqa")))
        return sdpa(q, k, v, **kw)
    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", record)
        eager = run(lambda q, k, v: kernels.attend(q, k, v, mask))
    assert heads == [(g, True)], heads
    fn = torch.compile(lambda q, k, v: kernels.attend(q, k, v, mask), fullgraph=True)
    run(fn)  # compiles forward and backward (tracing calls SDPA too): not what is counted
    with torch.profiler.profile() as prof:
        compiled = run(fn)
    calls = sdpa_calls(prof, 1)
    assert "math" not in calls and calls.endswith("1 fwd / 1 bwd"), calls
    if kernels._cudnn_attention(torch.device("cuda")):
        assert calls.startswith("cudnn"), calls
    want = _out_and_grads(lambda q, k, v: _literal(q, k, v, causal=True), *base)
    for a, b, c in zip(compiled, eager, want):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * float(b.abs().max()))
        torch.testing.assert_close(a.double().cpu(), c, rtol=3e-2, atol=3e-2 * float(c.abs().max()))
