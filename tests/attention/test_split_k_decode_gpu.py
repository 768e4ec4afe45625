"""GPU checks of ``split-k-decode`` (run with ``pytest -m gpu``): the Triton kernels against SDPA in
fp32 (1e-5) and against the float64 softmax in bf16/fp16, over ragged left-padded caches of one
and of several K/V heads; offsets past 2**31 elements; and generation through the policy that
chooses it (``model.generate`` eager, captured and compiled, sampling, beam search, the Hugging
Face adapter): the greedy tokens of the eager SDPA path, for MQA, GQA, folded MHE and MHE under
rotary positions."""

import math

import pytest
import torch
import torch.nn.functional as F

from mhe.attention import masks, triton_decode
from mhe.attention.flash_decode import range_mask
from mhe.models import build_model
from mhe.generation.beam import beam_search

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not triton_decode.available(), reason="needs Triton")]

SHAPES = [(9, 1, 64), (9, 3, 64), (32, 4, 64), (12, 1, 128), (16, 16, 64)]  # (h_q, h_kv, d): MQA, GQA, MHA


def ragged(b: int, s: int, pos: int, pads) -> tuple[torch.Tensor, ...]:
    key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    for row, pad in enumerate(pads):
        key_mask[row, :pad] = False
    return masks.decode_key_range(key_mask, torch.tensor(pos, device="cuda"), s, batch=b, device=torch.device("cuda"))


def case(hq, hk, d, dtype, *, b=4, s=1000, pos=700, pads=(0, 17, 300, 699), shared_layout=True, seed=0):
    """q laid out ``[B, 1, h_q, d]`` (as MHE's per-head factors and the split heads leave it), a
    ``[2, B, h_kv, S, d]`` cache's halves, and a ragged key range (row 3 sees two keys)."""
    torch.manual_seed(seed)
    q = torch.randn(b, 1, hq, d, device="cuda", dtype=dtype)
    q = q.transpose(1, 2) if shared_layout else q.reshape(b, hq, 1, d)
    kv = torch.randn(2, b, hk, s, d, device="cuda", dtype=dtype)
    return q, kv[0], kv[1], ragged(b, s, pos, pads)


def sdpa(q, k, v, key_range, scale=None):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=range_mask(key_range, k.shape[2]), enable_gqa=True,
                                          scale=scale)


@pytest.mark.parametrize("hq,hk,d", SHAPES)
@pytest.mark.parametrize("splits", [None, 1, 5, 128])
@pytest.mark.parametrize("fused", [None, False])
def test_fp32_equals_sdpa(hq, hk, d, splits, fused):
    """IEEE float32 products (no TF32): SDPA's fp32 output to 1e-5, one chunk or many, and the
    chunks of the policy's choice; merged by the last chunk (the default) or by the merge kernel."""
    q, k, v, kr = case(hq, hk, d, torch.float32)
    got = triton_decode.launch(q, k, v, kr[0], kr[1], 1 / math.sqrt(d), splits=splits, fused=fused)
    torch.testing.assert_close(got, sdpa(q, k, v, kr), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("hq,hk,d,b", [(9, 1, 64, 64), (32, 1, 64, 64), (32, 4, 64, 16)])
def test_fused_merge_is_the_same_at_every_launch_of_a_full_card(hq, hk, d, b):
    """Hundreds of programs, every SM busy, 100 launches back to back, each with a query of its
    own and the partials' memory filled with NaN just before (freed, so the launch's own partial
    buffers reuse it): a merge that read a chunk before its program had written it would read
    NaN or another launch's numbers. Each output equals the merge kernel's on the same query to
    1e-5 in fp32; the counters end at zero. Every case fuses (at least two chunks a row)."""
    q, k, v, kr = case(hq, hk, d, torch.float32, b=b, s=4096, pos=4095, pads=[0, 1000, 4000] + [7] * (b - 3))
    scale = 1 / math.sqrt(d)
    asked = []
    real = triton_decode._counters
    try:
        triton_decode._counters = lambda device, groups: asked.append(groups) or real(device, groups)
        for i in range(100):
            qi = torch.randn_like(q) * (1 + i % 3)
            poison = torch.full((b * hq * 128, d + 1), float("nan"), device="cuda")
            del poison
            got = triton_decode.launch(qi, k, v, kr[0], kr[1], scale)
            want = triton_decode.launch(qi, k, v, kr[0], kr[1], scale, fused=False)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    finally:
        triton_decode._counters = real
    assert len(asked) == 100  # the fused merge ran every time
    counters = triton_decode._COUNTERS.get(q.device)
    assert counters is None or int(counters.abs().sum()) == 0


@pytest.mark.two_gpus
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_launch_on_a_card_that_is_not_current_runs_on_the_tensors_card():
    """Tensors on cuda:1 while cuda:0 is current (a model decoding eagerly on a second card):
    the kernels launch on cuda:1 and equal SDPA there."""
    q, k, v, kr = case(9, 1, 64, torch.float32)
    q, k, v, kr = q.to("cuda:1"), k.to("cuda:1"), v.to("cuda:1"), tuple(t.to("cuda:1") for t in kr)
    with torch.cuda.device(0):
        got = triton_decode.launch(q, k, v, kr[0], kr[1], 0.125)
        want = sdpa(q, k, v, kr, scale=0.125)
    assert got.device == torch.device("cuda", 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_capture_without_counters_launches_the_merge_kernel(monkeypatch):
    """A step captured before any launch on the device (no counter buffer yet, and none can be
    made inside a capture) runs the two kernels, with the same numbers as the fused launch."""
    q, k, v, kr = case(9, 1, 64, torch.float32)
    triton_decode.launch(q, k, v, kr[0], kr[1], 0.125, splits=5, fused=False)  # compiled before the capture
    torch.cuda.synchronize()
    monkeypatch.setattr(triton_decode, "_COUNTERS", {})
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_decode.launch(q, k, v, kr[0], kr[1], 0.125, splits=5)
    assert triton_decode._COUNTERS == {}
    graph.replay()
    torch.testing.assert_close(out, triton_decode.launch(q, k, v, kr[0], kr[1], 0.125, splits=5), rtol=1e-6,
                               atol=1e-6)


@pytest.mark.parametrize("hq,hk,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_its_rounding_of_the_float64_softmax(hq, hk, d, dtype):
    """The probabilities rounded to the values' dtype before the product with V and the output
    rounded (relative 2^-8 each in bf16): |out - gold| <= 2 * eps * max|v|; SDPA's own error is
    the yardstick in norm."""
    q, k, v, kr = case(hq, hk, d, dtype)
    got = triton_decode.launch(q, k, v, kr[0], kr[1], 1 / math.sqrt(d))
    gold = sdpa(q.double(), k.double(), v.double(), kr)
    eps = 2 ** -8 if dtype == torch.bfloat16 else 2 ** -11
    assert (got.double() - gold).abs().max().item() <= 2 * eps * v.abs().max().item()
    err = ((got.double() - gold).norm() / gold.norm()).item()
    err_sdpa = ((sdpa(q, k, v, kr).double() - gold).norm() / gold.norm()).item()
    assert err <= 2 * err_sdpa + 1e-4, (err, err_sdpa)


def test_offsets_past_two_to_the_31_elements():
    """A cache of 2**31 + elements per half: the last row's keys start past int32's range."""
    b, s, d = 64, 540_000, 64  # 64 * 540000 * 64 = 2.2e9 elements a half, 4.4 GB in bf16
    torch.manual_seed(0)
    kv = torch.zeros(2, b, 1, s, d, device="cuda", dtype=torch.bfloat16)
    kv[:, -1, :, -3000:].normal_()
    kv[1, -1, :, -3000:] += 1.0  # values near 1: a wrapped offset would read zeros
    q = torch.randn(b, 8, 1, d, device="cuda", dtype=torch.bfloat16)
    kr = ragged(b, s, s - 1, [s - 3000] * b)
    got = triton_decode.launch(q, kv[0], kv[1], kr[0], kr[1], 1 / math.sqrt(d))
    last = (slice(-1, None), slice(None), slice(-3000, None))
    want = F.scaled_dot_product_attention(q[-1:].float(), kv[0][last].float(), kv[1][last].float(), enable_gqa=True)
    torch.testing.assert_close(got[-1:].float(), want, rtol=0.02, atol=0.02)
    del kv


def test_captured_and_compiled_calls_replay_the_eager_numbers():
    """The kernels inside a CUDA graph (eager kernels) and inside torch.compile + a graph
    (the ``mhe::split_k_decode`` operator): bit-identical to the eager launch."""
    q, k, v, kr = case(9, 3, 64, torch.bfloat16)
    want = triton_decode.split_k_decode_kernel(q, k, v, mask=None, is_causal=False, dropout_p=0.0, scale=None,
                                               key_range=kr)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: triton_decode.split_k_decode_kernel(
        a[0], a[1], a[2], mask=None, is_causal=False, dropout_p=0.0, scale=None, key_range=a[3:]), fullgraph=True)
    for fn in (lambda: triton_decode.split_k_decode_kernel(q, k, v, mask=None, is_causal=False, dropout_p=0.0,
                                                           scale=None, key_range=kr),
               lambda: compiled(q, k, v, *kr)):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fn()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    torch._dynamo.reset()


MODELS = [("tiny-decoder", "mqa", None), ("tiny-decoder", "gqa", {"n_kv_heads": 2}), ("tiny-decoder", "mhe-mul", None),
          ("llama-tiny", "mhe-mul", None), ("llama-tiny", "gqa", {"n_kv_heads": 2})]


def tiny(name, kind, opts, dtype):
    torch.manual_seed(0)
    model = build_model(name, attention=kind, attn_options=opts, dropout=0.0, attn_dropout=0.0)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)  # MHE's head embeddings away from their zero start
    return model.cuda().to(dtype).eval()


def prompts(b=4, p=11):
    ids = torch.randint(3, 1024, (b, p), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :9] = 0  # ragged: prompts of 11, 8, 2 and 11 tokens
    return ids, mask


@pytest.mark.parametrize("name,kind,opts", MODELS)
def test_fp32_generation_equals_the_eager_sdpa_path(name, kind, opts):
    """fp32 greedy decoding: the policy's kernel is ``split-k-decode``; eager steps through it equal
    eager SDPA steps to 1e-5 in the logits, and the default (compiled, captured) path chooses the
    same tokens as the eager SDPA path."""
    model = tiny(name, kind, opts, torch.float32)
    ids, mask = prompts()
    want, lw = model.generate(ids, 24, attention_mask=mask, step_mode="eager", kernel="sdpa", return_logits=True)
    eager = model.generator(4, 40, step_mode="eager")
    got, lg = model.generate(ids, 24, attention_mask=mask, session=eager, return_logits=True)
    assert eager.plan.kernel == "split-k-decode"
    assert torch.equal(got, want)
    torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-5)
    fast, lf = model.generate(ids, 24, attention_mask=mask, return_logits=True)  # compile + graph
    assert torch.equal(fast, want)
    torch.testing.assert_close(lf, lw, rtol=1e-4, atol=1e-4)  # inductor's fused arithmetic rounds otherwise


@pytest.mark.parametrize("name,kind,opts", MODELS)
def test_bf16_generation_graph_equals_eager_and_tracks_sdpa(name, kind, opts):
    """bf16: captured steps replay the eager kernels bit for bit; the traced step (the kernels one
    ``mhe::split_k_decode`` operator) is one graph for every token and chooses the eager tokens;
    the first decode step (same prompt) within bf16 of SDPA's."""
    model = tiny(name, kind, opts, torch.bfloat16)
    ids, mask = prompts()
    a, la = model.generate(ids, 20, attention_mask=mask, session=model.generator(4, 40, step_mode="eager"),
                           return_logits=True)
    g, lg = model.generate(ids, 20, attention_mask=mask, session=model.generator(4, 40, step_mode="graph"),
                           return_logits=True)
    assert torch.equal(a, g) and torch.equal(la, lg)
    s, ls = model.generate(ids, 20, attention_mask=mask, step_mode="eager", kernel="sdpa", return_logits=True)
    assert torch.equal(a[:, 11], s[:, 11])
    torch.testing.assert_close(la[:, 1].float(), ls[:, 1].float(), rtol=0.02, atol=0.05)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    session = model.generator(4, 40, step_mode="compile", compile_options={"backend": "aot_eager"})
    c, lc = model.generate(ids, 20, attention_mask=mask, session=session, return_logits=True)
    assert session.plan.kernel == "split-k-decode"
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == 2  # the step and the greedy choice, every step
    assert torch.equal(c, a)  # AOT's decompositions round some other operators otherwise: logits within bf16
    torch.testing.assert_close(lc.float(), la.float(), rtol=0.02, atol=0.05)


def test_mha_at_batch_one_decodes_through_the_kernel():
    """MHA at batch 1: the policy picks ``split-k-decode`` in bf16 (not in fp32); in fp32 its eager
    steps equal SDPA's to 1e-5 with the same tokens; in bf16 the captured graph replays the eager
    kernels bit for bit and the first step tracks SDPA's within bf16."""
    ids = torch.randint(3, 1024, (1, 11), device="cuda")
    model = tiny("llama-tiny", "mha", None, torch.float32)
    fp32 = model.generator(1, 40, step_mode="eager")
    model.generate(ids, 2, session=fp32)
    assert fp32.plan.kernel == "eager-one-token"  # the plan is made by the session's first call
    want, lw = model.generate(ids, 24, step_mode="eager", kernel="sdpa", return_logits=True)
    got, lg = model.generate(ids, 24, step_mode="eager", kernel="split-k-decode", return_logits=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-5)
    model = model.to(torch.bfloat16)
    eager = model.generator(1, 40, step_mode="eager")
    a, la = model.generate(ids, 20, session=eager, return_logits=True)
    assert eager.plan.kernel == "split-k-decode"
    g, lg = model.generate(ids, 20, session=model.generator(1, 40, step_mode="graph"), return_logits=True)
    assert torch.equal(a, g) and torch.equal(la, lg)
    s, ls = model.generate(ids, 20, step_mode="eager", kernel="sdpa", return_logits=True)
    torch.testing.assert_close(la[:, 1].float(), ls[:, 1].float(), rtol=0.02, atol=0.05)


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factors_in_the_kernel_equal_the_unfused_heads(kind, dtype, monkeypatch):
    """MHE under rotary positions with its per-head factors (offsets) applied inside the kernel
    (``kernels.FactoredQuery``), against the heads made first by the compiled step (the unfused
    path, ``FACTORS_IN_KERNEL`` off): the default compiled, captured generation, ragged
    prompts; fp32 logits to 1e-5 and the same greedy tokens; bf16 the same first token and the
    first decode step's logits within bf16's rounding."""
    model = tiny("llama-tiny", kind, None, dtype)
    ids, mask = prompts()
    launches = []
    real = triton_decode.launch
    monkeypatch.setattr(triton_decode, "launch", lambda *a, **kw: launches.append(kw.get("factors") is not None)
                        or real(*a, **kw))
    fused, lf = model.generate(ids, 24, attention_mask=mask, session=model.generator(4, 40), return_logits=True)
    monkeypatch.setattr(triton_decode, "FACTORS_IN_KERNEL", False)
    torch._dynamo.reset()
    plain, lp = model.generate(ids, 24, attention_mask=mask, session=model.generator(4, 40), return_logits=True)
    assert launches and launches[0] and not launches[-1]  # traced once each way: with factors, then without
    if dtype == torch.float32:
        assert torch.equal(fused, plain)
        torch.testing.assert_close(lf, lp, rtol=1e-5, atol=1e-5)
    else:  # the unfused kernel rounds the rotated query once, after the factor; the fused one before it too
        assert torch.equal(fused[:, 11], plain[:, 11])
        torch.testing.assert_close(lf[:, 1].float(), lp[:, 1].float(), rtol=0.02, atol=0.05)
    torch._dynamo.reset()


def test_sampling_through_the_kernel_replays_the_eager_draws():
    model = tiny("llama-tiny", "mhe-mul", None, torch.float32)
    ids, mask = prompts()
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.9, top_k=50, seed=5, return_logits=True)
    eager = model.generator(4, 40, step_mode="eager")
    a, la = model.generate(ids, 16, session=eager, **kw)
    b, lb = model.generate(ids, 16, session=model.generator(4, 40, step_mode="graph"), **kw)
    assert eager.plan.kernel == "split-k-decode"
    assert torch.equal(a, b) and torch.equal(la, lb)


@pytest.mark.parametrize("kind,opts", [("mqa", None), ("gqa", {"n_kv_heads": 2}), ("mhe-mul", None)])
def test_beam_search_through_the_kernel_equals_the_eager_one_token_path(kind, opts, monkeypatch):
    """fp32 beam search (decoder self-attention through ``split-k-decode``, cross-attention over
    right-padded sources through its dense-mask path): the hypotheses of the policy without Triton."""
    s2s = tiny("tiny-encoder-decoder", kind, opts, torch.float32)
    src = torch.randint(3, 1024, (4, 7), device="cuda")
    smask = torch.ones_like(src, dtype=torch.bool)
    smask[1, 5:] = False
    got, sg = beam_search(s2s, src, smask, bos_id=1, eos_id=2, beam=3, max_len=14, return_scores=True)
    monkeypatch.setattr(triton_decode, "available", lambda: False)
    want, sw = beam_search(s2s, src, smask, bos_id=1, eos_id=2, beam=3, max_len=14, step_mode="eager",
                           return_scores=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(sg, sw, rtol=1e-5, atol=1e-5)


def test_hf_adapter_generates_through_the_kernel():
    pytest.importorskip("transformers")
    from mhe.hf import to_hf
    from mhe.generation import session as generator_module

    model = tiny("tiny-decoder", "mhe-mul", None, torch.float32)
    hf = to_hf(model).eval()
    ids, mask = prompts()
    ids = ids.masked_fill(mask == 0, 0)
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                      cache_implementation="static")
    want = model.generate(ids, 12, attention_mask=mask, step_mode="eager", kernel="sdpa")
    assert torch.equal(out, want)
    assert any(s.plan.kernel == "split-k-decode" for s in generator_module._DEFAULT[model])
