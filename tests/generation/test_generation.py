"""Generation: static-cache decode steps (compiled once) against eager decoding, sampling,
stop tokens, streaming, and left-padded batches against one-by-one generation."""

import pytest
import torch

from mhe.attention import KINDS, attention_class
from mhe.errors import MheError
from mhe.models import build_model
from mhe.generation.beam import beam_search
from mhe.generation.sampling import SamplingConfig, filter_logits
from reference import generate_uncached

CACHE_KINDS = [k for k in KINDS if attention_class(k).supports_cache]
SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)
AOT = {"backend": "aot_eager"}  # the eager kernels through dynamo + AOTAutograd: fast to build on a CPU


def small(name, kind, **kw):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    model = build_model(name, attention=kind, attn_options=opts, **{**SMALL, **kw}).double().eval()
    with torch.no_grad():  # MHE head embeddings far from zero, so folding is exercised
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)
    return model


def left_padded():
    ids = torch.randint(3, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def graphs_built() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_compiled_decode_equals_eager_and_compiles_once(kind):
    model = small("tiny-decoder", kind)
    ids, mask = left_padded()
    want, want_logits = model.generate(ids, 17, attention_mask=mask, step_mode="eager", return_logits=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, logits = model.generate(ids, 17, attention_mask=mask, step_mode="compile", compile_options=AOT,
                                 return_logits=True)
    assert graphs_built() == 2  # the decode step and the greedy choice, each once for 16 steps
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", [k if k in ("mha", "gqa", "mhe-mul") else pytest.param(k, marks=pytest.mark.slow)
                                  for k in CACHE_KINDS])
def test_compiled_beam_search_equals_eager(kind):
    model = small("tiny-encoder-decoder", kind)
    src = torch.randint(3, 99, (2, 6))
    smask = torch.ones(2, 6, dtype=torch.bool)
    smask[1, 4:] = False
    attributes = set(vars(model))
    a, sa = beam_search(model, src, smask, bos_id=1, eos_id=2, beam=3, max_len=18, step_mode="eager",
                        return_scores=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    b, sb = beam_search(model, src, smask, bos_id=1, eos_id=2, beam=3, max_len=18, step_mode="compile",
                        compile_options=AOT, return_scores=True)
    assert graphs_built() == 1
    assert torch.equal(a, b)
    torch.testing.assert_close(sb, sa, rtol=1e-12, atol=1e-12)
    assert set(vars(model)) == attributes  # the captured steps were the searcher's, not the model's


@pytest.mark.slow
def test_inductor_compiled_decode_equals_eager():
    model = small("tiny-decoder", "mhe-mul")
    ids = torch.randint(3, 99, (2, 5))
    want, wl = model.generate(ids, 17, step_mode="eager", return_logits=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    got, gl = model.generate(ids, 17, step_mode="compile", return_logits=True)
    assert graphs_built() == 2 and torch.equal(got, want)
    torch.testing.assert_close(gl, wl, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_left_padded_batch_equals_one_by_one(kind):
    """Logits level: a left-padded batch, cached, equals each prompt alone, cached and uncached."""
    model = small("tiny-decoder", kind)
    ids, mask = left_padded()
    _, batch = model.generate(ids, 8, attention_mask=mask, return_logits=True)
    _, full = generate_uncached(model, ids, 8, attention_mask=mask, return_logits=True)
    torch.testing.assert_close(batch, full, rtol=1e-10, atol=1e-10)
    for row, start in ((0, 0), (1, 3)):
        _, alone = model.generate(ids[row:row + 1, start:], 8, return_logits=True)
        torch.testing.assert_close(batch[row:row + 1], alone, rtol=1e-10, atol=1e-10)


def test_padding_changes_nothing_only_when_masked():
    """The same padded batch without its mask gives other logits (so the test above can fail)."""
    model = small("tiny-decoder", "mqa")
    ids, mask = left_padded()
    _, masked = model.generate(ids, 4, attention_mask=mask, return_logits=True)
    _, unmasked = model.generate(ids, 4, return_logits=True)
    assert not torch.allclose(masked[1], unmasked[1])


def test_sampling_is_reproducible_under_a_seed():
    model = small("tiny-decoder", "mhe-mul")
    ids = torch.randint(3, 99, (3, 4))
    kw = dict(do_sample=True, temperature=1.5, top_k=20, top_p=0.9)
    a = model.generate(ids, 12, seed=7, **kw)
    assert torch.equal(a, model.generate(ids, 12, seed=7, **kw))
    assert not torch.equal(a, model.generate(ids, 12, seed=8, **kw))
    assert torch.equal(model.generate(ids, 12, do_sample=True, top_k=1, seed=3), model.generate(ids, 12))


def test_sampled_tokens_respect_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    kept = lambda cfg: torch.isfinite(filter_logits(logits, cfg))[0].nonzero().flatten().tolist()  # noqa: E731
    assert kept(SamplingConfig(do_sample=True, top_k=2)) == [0, 1]
    assert kept(SamplingConfig(do_sample=True, top_p=0.65)) == [0, 1]  # 0.4 < 0.65 <= 0.7
    assert kept(SamplingConfig(do_sample=True, top_p=0.7001)) == [0, 1, 2]
    assert kept(SamplingConfig(do_sample=True, top_p=0.1)) == [0]  # the most likely token always stays
    uniform = torch.zeros(1, 4)  # probabilities 1/4 each, their sums exact: a mass of exactly 1 - top_p goes
    for top_p, n in ((0.5, 2), (0.75, 3), (0.7, 3)):
        assert int(torch.isfinite(filter_logits(uniform, SamplingConfig(do_sample=True, top_p=top_p))).sum()) == n
    model = small("tiny-decoder", "mha")
    ids = torch.randint(3, 99, (4, 3))
    _, steps = model.generate(ids, 6, return_logits=True)
    out = model.generate(ids, 6, do_sample=True, top_k=3, seed=0)
    top3 = steps.topk(3, -1).indices  # [B, n, 3]: the sampled tokens come from the greedy path's logits
    assert bool((out[:, 3:4, None] == top3[:, :1]).any(-1).all())


def test_stop_tokens_streaming_and_limits():
    model = small("tiny-decoder", "mhe-mul")
    ids = torch.randint(3, 99, (2, 4))
    free = model.generate(ids, 10)
    stop = int(free[0, 4])  # row 0's first new token
    seen = []
    out = model.generate(ids, 10, stop_ids=[stop], pad_id=0, streamer=seen.append)
    assert out[0, 4] == stop and bool((out[0, 5:] == 0).all())
    hits = (free[1, 4:] == stop).nonzero().flatten().tolist()
    end = 4 + (hits[0] + 1 if hits else 10)  # row 1 runs until it emits the stop token too
    assert torch.equal(out[1, 4:end], free[1, 4:end]) and bool((out[1, end:] == 0).all())
    assert torch.equal(torch.tensor(seen).T, out[:, 4:])  # streamed as generated
    with pytest.raises(MheError, match="exceeds the model's max_len 40"):
        model.generate(ids, 37)
    with pytest.raises(MheError, match="left-padded"):
        model.generate(ids, 3, attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]))
    with pytest.raises(MheError, match="top_p must be in"):
        model.generate(ids, 3, do_sample=True, top_p=0.0)


def test_generation_reuses_the_captured_step_until_weights_change():
    model = small("tiny-decoder", "mhe-mul")
    ids = torch.randint(3, 99, (2, 4))
    session = model.generator(2, 9)
    a, la = model.generate(ids, 5, session=session, return_logits=True)
    view, regions = session.view, dict(session.runners.runners)
    assert torch.equal(model.generate(ids, 5, session=session), a)
    assert session.view is view and session.runners.runners == regions  # the same view and region, reused
    with torch.no_grad():
        model.decoder.final_norm.weight.mul_(3.0)
    _, lb = model.generate(ids, 5, session=session, return_logits=True)
    assert session.view is not view  # folded weights rebuilt
    _, fresh = model.generate(ids, 5, session=model.generator(2, 9), return_logits=True)
    assert torch.equal(lb, fresh) and not torch.allclose(la, lb)  # the new weights', as a fresh session's


def test_why_each_row_stopped():
    model = small("tiny-decoder", "mhe-mul")
    ids = torch.randint(3, 99, (2, 4))
    free = model.generate(ids, 10)
    stop = int(free[0, 6])  # row 0 ends at its third new token at the latest
    res = model.generate(ids, 10, stop_ids=[stop], pad_id=0, return_dict=True)
    for r in range(2):
        hits = (free[r, 4:] == stop).nonzero().flatten().tolist()
        assert res.finish_reasons()[r] == ("stop" if hits else "length")
        assert int(res.new_tokens[r]) == (hits[0] + 1 if hits else 10)
    assert res.finish_reasons()[0] == "stop" and int(res.new_tokens[0]) <= 3
    plain = model.generate(ids, 10, return_dict=True)
    assert torch.equal(plain.tokens, free) and plain.finish_reasons() == ["length", "length"]
    assert plain.new_tokens.tolist() == [10, 10] and plain.logits is None


def test_min_new_tokens_holds_back_the_stop_tokens():
    """As transformers' ``min_new_tokens``: a stop token cannot be chosen before a row has that
    many new tokens; the logits returned are the model's own."""
    model = small("tiny-decoder", "mhe-mul")
    ids = torch.randint(3, 99, (2, 4))
    free, logits = model.generate(ids, 6, return_logits=True)
    stop = int(free[0, 4])  # row 0's greedy first token
    res = model.generate(ids, 6, stop_ids=[stop], min_new_tokens=2, return_dict=True, return_logits=True)
    assert torch.equal(res.logits[:, 0], logits[:, 0])  # the same prompt: the same logits
    second = logits[0, 0].clone()
    second[stop] = float("-inf")
    assert int(res.tokens[0, 4]) == int(second.argmax()) != stop  # the best token that is not a stop token
    assert stop not in res.tokens[:, 4:6].flatten().tolist()
    never = model.generate(ids, 6, stop_ids=[stop], min_new_tokens=6, return_dict=True)
    assert never.finish_reasons() == ["length", "length"] and stop not in never.tokens[:, 4:].flatten().tolist()
    with pytest.raises(MheError, match="min_new_tokens must be a non-negative integer, got -1"):
        model.generate(ids, 3, min_new_tokens=-1)


def test_a_held_session_is_reused_checked_and_nothing_is_kept_on_the_model():
    model = small("tiny-decoder", "mqa")
    ids, mask = left_padded()
    attributes = set(vars(model))
    session = model.generator(2, 20)
    a = model.generate(ids, 8, attention_mask=mask, session=session)
    assert torch.equal(a, model.generate(ids, 8, attention_mask=mask))  # as a session of the exact size
    b = model.generate(ids[:, 3:], 5, session=session)  # another length, no padding: the same session
    assert torch.equal(b, model.generate(ids[:, 3:], 5))
    assert {padded for padded, _ in session.runners.runners} == {False, True}  # one step with a key mask, one without
    with pytest.raises(MheError, match="holds 2 rows of 20 positions; got 1 prompts"):
        model.generate(ids[:1], 3, session=session)
    with pytest.raises(MheError, match="got 2 prompts of 6 tokens \\+ 15 new"):
        model.generate(ids, 15, session=session)
    with pytest.raises(MheError, match="belong to the session"):
        model.generate(ids, 3, session=session, step_mode="eager")
    with pytest.raises(MheError, match="was built for torch.float64"):
        model.float().generate(ids, 3, session=session)
    assert set(vars(model)) == attributes  # the caller holds the state, not the model
