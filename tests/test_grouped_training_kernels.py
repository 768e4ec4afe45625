"""The Llama-style training step's attention calls: one unmasked causal SDPA call per layer with the
heads laid out as the projections give them, grouped K/V heads kept off cuDNN under autograd, and
both changes leave the function as it was (float64, bit for bit)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from conftest import B, D_MODEL, N_HEADS, T, VOCAB
from mhe.attention import kernels
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
    equal, bit for bit, those of the factors applied to ``[B, 1, T, d]`` directly (as before)."""
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
    assert all(torch.equal(a, b) for a, b in zip(now, was))


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
