"""GPU checks of the captured per-token region (run with ``pytest -m gpu``): replayed CUDA graphs
choose exactly the eager tokens, greedy and sampled (a private seeded generator and the global
one), the compiled step inside the graph agrees with eager, and the adapter runs the same step."""

import pytest
import torch

from mhe.models import build_model

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny(kind, dtype=torch.bfloat16):
    torch.manual_seed(0)
    return build_model("tiny-decoder", attention=kind, dropout=0.0, attn_dropout=0.0).cuda().to(dtype).eval()


def prompts():
    ids = torch.randint(3, 1024, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids, mask


@cuda
@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
def test_graph_region_samples_the_eager_tokens(kind):
    """Sampling inside the replayed graph: the same tokens and logits as eager, under a seed (the
    session's generator, registered with the graph) and from the global generator; a second call
    replays and draws alike."""
    model = tiny(kind)
    ids, mask = prompts()
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.9, top_k=50, top_p=0.9, return_logits=True)
    eager, graph = (model.generator(3, 30, step_mode=mode) for mode in ("eager", "graph"))
    for seed in (7, None):
        results = []
        for session in (eager, graph, graph):
            if seed is None:
                torch.manual_seed(11)
            results.append(model.generate(ids, 20, session=session, seed=seed, **kw))
        (a, la), (b, lb), (c, lc) = results
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(b, c) and torch.equal(lb, lc), seed


@cuda
@pytest.mark.parametrize("kind", ["mha", "mqa", "mhe-mul"])
def test_compiled_region_agrees_with_eager(kind):
    """The inductor-compiled step captured with the choice (fp32: the fused arithmetic differs from
    eager's in rounding only): the same greedy tokens, logits within 1e-4, stop tokens applied."""
    model = tiny(kind, torch.float32)
    ids, mask = prompts()
    want, wl = model.generate(ids, 16, attention_mask=mask, step_mode="eager", return_logits=True)
    session = model.generator(3, 30, step_mode="compile")
    got, gl = model.generate(ids, 16, attention_mask=mask, session=session, return_logits=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(gl, wl, rtol=1e-4, atol=1e-4)
    stop = int(want[1, 11])
    res = model.generate(ids, 16, attention_mask=mask, session=session, stop_ids=[stop], pad_id=0, return_dict=True)
    ref = model.generate(ids, 16, attention_mask=mask, step_mode="eager", stop_ids=[stop], pad_id=0, return_dict=True)
    assert torch.equal(res.tokens, ref.tokens) and res.finish_reasons() == ref.finish_reasons()


@cuda
@pytest.mark.parametrize("kind", ["mha", "gqa", "mhe-mul"])
def test_one_row_compiled_step_takes_coordinate_descent_and_agrees_with_eager(kind, monkeypatch):
    """A batch of one compiles with coordinate-descent tuning unless told otherwise (its bias-free
    one-row products become Triton reductions): ``torch.compile`` is given the option, and the
    Llama-style decoder in fp32 gives the eager tokens and logits within 1e-4; two rows and given
    options keep what they had."""
    from mhe.generation.step import ONE_ROW_COMPILE_OPTIONS

    compiled_with, compile = [], torch.compile

    def recording(fn, **kw):
        compiled_with.append(kw.get("options"))
        return compile(fn, **kw)
    monkeypatch.setattr(torch, "compile", recording)

    torch.manual_seed(0)
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    model = build_model("llama-tiny", attention=kind, attn_options=opts).cuda().float().eval()
    ids = torch.randint(3, 1024, (1, 9), device="cuda")
    want, wl = model.generate(ids, 16, step_mode="eager", return_logits=True)
    session = model.generator(1, 30, step_mode="compile")
    assert session.compile_options == ONE_ROW_COMPILE_OPTIONS
    got, gl = model.generate(ids, 16, session=session, return_logits=True)
    assert compiled_with and all(o == ONE_ROW_COMPILE_OPTIONS["options"] for o in compiled_with)
    assert torch.equal(got, want)
    torch.testing.assert_close(gl, wl, rtol=1e-4, atol=1e-4)
    assert model.generator(2, 30, step_mode="compile").compile_options is None
    assert model.generator(1, 30, step_mode="compile", compile_options={}).compile_options == {}


@cuda
def test_adapter_generate_runs_the_captured_step_on_cuda():
    pytest.importorskip("transformers")
    from mhe.hf import to_hf
    from mhe.generation import session as generate_module

    model = tiny("mhe-mul")
    ids, mask = prompts()
    hf = to_hf(model).eval()
    got = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                      cache_implementation="static")
    assert torch.equal(got, model.generate(ids, 12, attention_mask=mask))
    session = generate_module._DEFAULT[model][-1]
    assert session.caches[0].k.shape[1] == 1 and session.mode in ("graph", "compile")


@cuda
@pytest.mark.parametrize("kind", ["mha", "gqa", "mhe-mul"])
def test_captured_prefill_replays_the_eager_prefill(kind, monkeypatch):
    """A capturing session replays its prefill as a CUDA graph, one per prompt shape: the eager
    kernels, so the same logits to the bit and the same tokens as an eager session, for ragged
    left-padded and for unpadded prompts; a shape's first call runs eagerly, its second captures,
    later ones replay, and prompts over ``PREFILL_GRAPH_TOKENS`` run eagerly."""
    from mhe.generation import session as sessions

    torch.manual_seed(0)
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    model = build_model("llama-tiny", attention=kind, attn_options=opts).cuda().to(torch.bfloat16).eval()
    ids, mask = prompts()
    eager, graph = (model.generator(3, 40, step_mode=mode) for mode in ("eager", "graph"))
    for args in ((ids, mask), (ids, None), (ids[:, 2:], mask[:, 2:])):
        kw = dict(attention_mask=args[1], return_logits=True)
        want, wl = model.generate(args[0], 12, session=eager, **kw)
        for calls in range(3):
            got, gl = model.generate(args[0], 12, session=graph, **kw)
            assert torch.equal(got, want) and torch.equal(gl, wl)
            assert ((3, args[0].shape[1], args[1] is not None) in graph.prefills.runners) == (calls > 0)
    assert sorted(graph.prefills.runners) == [(3, 7, True), (3, 9, False), (3, 9, True)]
    assert not eager.prefills.runners
    monkeypatch.setattr(sessions, "PREFILL_GRAPH_TOKENS", 3 * 9 - 1)
    graph.prefills.clear()
    got, gl = model.generate(ids, 12, session=graph, attention_mask=mask, return_logits=True)
    want, wl = model.generate(ids, 12, session=eager, attention_mask=mask, return_logits=True)
    assert not graph.prefills.runners and torch.equal(gl, wl)


@cuda
@pytest.mark.parametrize("kind", ["mha", "gqa", "mhe-mul"])
def test_compiled_long_prefill_agrees_with_eager(kind, monkeypatch):
    """From ``PREFILL_COMPILE_TOKENS`` a ``compile`` session runs its prefill compiled by inductor
    from a shape's second call: in fp32 its logits are the eager prefill's to 1e-5 (inductor's
    fused arithmetic rounds differently, nothing else) and the greedy tokens of the whole call are
    the eager session's, for ragged left-padded and unpadded prompts of 3 x 100 tokens."""
    from mhe.generation import session as sessions

    monkeypatch.setattr(sessions, "PREFILL_GRAPH_TOKENS", 256)
    monkeypatch.setattr(sessions, "PREFILL_COMPILE_TOKENS", 257)
    torch.manual_seed(0)
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    model = build_model("llama-tiny", attention=kind, attn_options=opts).cuda().float().eval()
    ids = torch.randint(3, 1024, (3, 100), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    eager, fast = (model.generator(3, 120, step_mode=mode) for mode in ("eager", "compile"))
    for m in (mask, None):
        want, wl = model.generate(ids, 12, attention_mask=m, session=eager, return_logits=True)
        for _ in range(2):
            got, gl = model.generate(ids, 12, attention_mask=m, session=fast, return_logits=True)
            assert torch.equal(got, want)
            torch.testing.assert_close(gl[:, 0], wl[:, 0], rtol=1e-5, atol=1e-5)
    assert sorted(fast.compiled_prefills.runners) == [(3, 100, False), (3, 100, True)]
    assert not any(r.fell_back for r in fast.compiled_prefills.runners.values())


@cuda
@pytest.mark.parametrize("kind,opts", [("gqa", {"n_kv_heads": 2}), ("mha", None), ("mhe-mul", None)])
def test_rotary_step_equals_the_unfused_path(kind, opts, monkeypatch):
    """Under rotary positions on the card, fp32, ragged left-padded prompts: the rotating step's
    kernel (``kv_cache.ROTARY_STEP`` on; it ran) chooses the unfused path's tokens (the rotary
    embedding and ``torch.stack``, the switch off) with eager steps' logits within 1e-5, and so
    does the compiled step with the operator between inductor's fused product and the cache
    write (that the compiled step holds the operator, once a layer, is checked on a CPU:
    ``tests/attention/test_rotary_step.py``)."""
    from mhe.attention import kv_cache, rotary_step

    torch.manual_seed(0)
    model = build_model("llama-tiny", attention=kind, attn_options=opts, dropout=0.0, attn_dropout=0.0)
    model = model.cuda().float().eval()
    ids, mask = prompts()
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)
    want, wl = model.generate(ids, 16, attention_mask=mask, step_mode="eager", return_logits=True)
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", True)
    launches, launch = [], rotary_step.launch_step
    monkeypatch.setattr(rotary_step, "launch_step", lambda *a: launches.append(1) or launch(*a))
    fused, fl = model.generate(ids, 16, attention_mask=mask, step_mode="eager", return_logits=True)
    assert launches, "the rotating step's kernel did not run"
    assert torch.equal(fused, want)
    torch.testing.assert_close(fl, wl, rtol=1e-5, atol=1e-5)
    got, gl = model.generate(ids, 16, attention_mask=mask, session=model.generator(3, 30, step_mode="compile"),
                             return_logits=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(gl, wl, rtol=1e-5, atol=1e-5)
