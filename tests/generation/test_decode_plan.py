"""The decode choice is one object passed down the call: a session's :class:`DecodePlan` reaches every
attention sublayer of a step through the forward calls, no sublayer's configuration carries it,
and no two layers of one step run different kernels (even where their configurations differ)."""

import dataclasses

import pytest
import torch

from mhe.attention import kernels
from mhe.attention.base import attention_sublayers, set_kernel
from mhe.attention.kernels import DecodePlan
from mhe.errors import MheError
from mhe.generation.beam import BeamSearcher, beam_search
from mhe.models import build_model

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=3, max_len=40, dropout=0.0, attn_dropout=0.0)


@pytest.fixture
def calls(monkeypatch):
    """The kernel of every attention call, in order (a spy on ``kernels.attend``)."""
    seen = []
    original = kernels.attend

    def spy(q, k, v, mask=None, **kw):
        seen.append(kw.get("kernel", "sdpa"))
        return original(q, k, v, mask, **kw)
    monkeypatch.setattr(kernels, "attend", spy)
    return seen


def configs(module):
    return [a.cfg for a in attention_sublayers(module)]


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_a_sessions_plan_reaches_every_layer_and_no_sublayer_config(kind, calls):
    torch.manual_seed(0)
    opts = {"attn_options": {"n_kv_heads": 2}} if kind == "gqa" else {}
    model = build_model("tiny-decoder", attention=kind, **SMALL, **opts).double().eval()
    before = configs(model)
    ids = torch.randint(3, 99, (2, 5))
    want = model.generate(ids, 4, kernel="sdpa", step_mode="eager")
    session = model.generator(2, 12, kernel="eager", step_mode="eager")
    calls.clear()
    got = model.generate(ids, 4, session=session)
    assert torch.equal(got, want)  # a kernel never changes the tokens
    assert session.plan == DecodePlan("eager", "dense")
    assert calls == ["eager"] * (SMALL["n_layers"] * 4)  # the prefill and 3 steps, every layer
    assert configs(model) == before and configs(session.view) == before  # the choice is in no sublayer
    assert all(c.kernel == "sdpa" for c in configs(session.view))


def test_a_plan_overrides_layers_configured_apart(calls):
    """Two sublayers configured with different kernels still run one kernel under a plan; without
    one each runs its own (the configured kernel is a model setting, not the decode choice)."""
    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention="mqa", **SMALL).double().eval()
    set_kernel(model.decoder.layers[0], "eager")
    ids = torch.randint(3, 99, (2, 5))
    caches = model.new_caches(2, 8)
    calls.clear()
    plain = model(ids, caches=caches).logits
    assert calls == ["eager", "sdpa", "sdpa"]
    caches = model.new_caches(2, 8)
    calls.clear()
    planned = model(ids, caches=caches, plan=DecodePlan.of("matmul-decode")).logits
    assert calls == ["matmul-decode"] * 3
    torch.testing.assert_close(planned, plain, rtol=0, atol=1e-12)


def test_beam_search_plan_reaches_the_decoder_not_the_encoder(calls, monkeypatch):
    torch.manual_seed(0)
    model = build_model("tiny-encoder-decoder", attention="mha", **SMALL).double().eval()
    before = configs(model)
    src = torch.randint(3, 99, (2, 6))
    searcher = BeamSearcher(model, step_mode="eager")
    with monkeypatch.context() as m:
        m.setattr(kernels, "decode_kernel", lambda *a, **kw: "matmul-decode")  # as a card's policy might choose
        calls.clear()
        got = beam_search(model, src, bos_id=1, eos_id=2, beam=2, max_len=4, searcher=searcher)
    assert searcher.plan == DecodePlan("matmul-decode", "dense")
    n = SMALL["n_layers"]
    assert calls[:n] == ["sdpa"] * n  # the encoder: its configured kernel
    assert calls[n:] and set(calls[n:]) == {"matmul-decode"}  # the decoder's self- and cross-attention
    assert configs(model) == before and configs(searcher.view) == before
    want = beam_search(model, src, bos_id=1, eos_id=2, beam=2, max_len=4, step_mode="eager")
    assert torch.equal(got, want)


def test_a_plan_is_checked_and_frozen():
    assert DecodePlan.of("flash-decode") == DecodePlan("flash-decode", "key-range")
    assert DecodePlan.of("flash-decode", dense=True).mask_form == "dense"  # every kernel reads dense masks
    assert DecodePlan.of("sdpa").mask_form == "dense"
    with pytest.raises(MheError, match="reads no key ranges"):
        DecodePlan("sdpa", "key-range")
    with pytest.raises(MheError, match="'nope'"):
        DecodePlan("nope")
    with pytest.raises(MheError, match="mask form"):
        DecodePlan("sdpa", "sparse")
    with pytest.raises(dataclasses.FrozenInstanceError):
        DecodePlan("sdpa").kernel = "eager"
    fields = {f.name for f in dataclasses.fields(configs(build_model("tiny-decoder", **SMALL))[0])}
    assert not fields & {"plan", "decode_kernel", "mask_form"}  # a sublayer's configuration has no decode choice
