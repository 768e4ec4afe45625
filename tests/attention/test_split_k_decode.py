"""The ``split-k-decode`` kernel (``attention/triton_decode.py``): its Triton kernels run by Triton's
interpreter (``TRITON_INTERPRET=1``, CPU tensors) against the literal softmax in float64, its
fallback to ``sdpa``, its registration, the generation policy that chooses it, and generation
through it for MQA, GQA, folded MHE and MHE under rotary positions with ragged, left-padded
prompts. The GPU checks are in ``test_split_k_decode_gpu.py``."""

import math

import pytest
import torch

from mhe.attention.masks import AttentionMask
from mhe.attention import KERNELS, build_attention, kernels, masks, triton_decode
from mhe.attention.flash_decode import key_offsets, range_mask
from mhe.attention.kernels import EXPAND_MAX_POSITIONS, DecodePlan, attend, decode_kernel, reads_key_range
from mhe.models import build_model
from reference import softmax_attention

launch = triton_decode.launch
CUDA = torch.device("cuda")  # only its type is read on a CPU-only machine
needs_triton = pytest.mark.skipif(not triton_decode.available(), reason="Triton is not installed "
                                  "(pip install triton; the interpreter runs its kernels on a CPU)")


@pytest.fixture
def interpret():
    """Triton's interpreter: the kernels run on CPU tensors, in float64 where the inputs are.
    conftest.py turns it on before Triton is imported, on a machine without a GPU."""
    if not triton_decode.interpreting():
        pytest.skip("Triton's interpreter is on only without a GPU (TRITON_INTERPRET=1 before importing triton)")


def ragged_range(batch: int, length: int, pos: int, pads: list[int]) -> tuple[torch.Tensor, ...]:
    """The key range of one causal query at ``pos`` over a cache of ``length`` with left padding
    ``pads`` per row, as a decode step's model builds it."""
    key_mask = torch.ones(batch, length, dtype=torch.bool)
    for row, pad in enumerate(pads):
        key_mask[row, :pad] = False
    return masks.decode_key_range(key_mask, torch.tensor(pos), length, batch=batch, device=torch.device("cpu"))


def gold(q, k, v, key_range) -> torch.Tensor:
    """The literal softmax per query head (Eq. 3) in float64, head i reading K/V head i // G."""
    b, hq, _, _ = q.shape
    g = hq // k.shape[1]
    allowed = range_mask(key_range, k.shape[2])[:, 0, 0]  # [B, S]
    heads = [softmax_attention(q[:, i].double(), k[:, i // g].double(), v[:, i // g].double(), key_mask=allowed)
             for i in range(hq)]
    return torch.stack(heads, 1)  # [B, h_q, 1, d]


def inputs(b, hq, hk, s, d, dtype, *, shared_query_layout=False):
    """q ``[B, h_q, 1, d]`` (optionally laid out ``[B, 1, h_q, d]`` with unit-free strides, as MHE's
    per-head factors leave it) and a cache ``k, v`` of ``[2, B, h_kv, S, d]``'s halves."""
    q = torch.randn(b, 1, hq, d, dtype=dtype).transpose(1, 2) if shared_query_layout else \
        torch.randn(b, hq, 1, d, dtype=dtype)
    kv = torch.randn(2, b, hk, s, d, dtype=dtype)
    return q, kv[0], kv[1]


def test_registered_as_a_key_range_kernel():
    assert "split-k-decode" in KERNELS and reads_key_range("split-k-decode")
    assert build_attention("gqa", d_model=32, n_heads=4, n_kv_heads=2, kernel="split-k-decode").cfg.kernel == \
        "split-k-decode"


def test_choose_splits_fills_the_card_within_its_bounds():
    assert triton_decode.choose_splits(64, 4096, 132) == 4  # at most 2 programs per SM: one wave
    assert triton_decode.choose_splits(192, 4096, 132) == 1  # 3 K/V heads: not 2 chunks (384 > 264 programs)
    assert triton_decode.choose_splits(1, 4096, 132) == 32  # at least 128 positions (one loop step) a chunk
    assert triton_decode.choose_splits(1, 32768, 132) == triton_decode.MAX_SPLITS
    assert triton_decode.choose_splits(4096, 32768, 132) == 1  # enough rows: no split, no merge


@needs_triton
@pytest.mark.parametrize("hq,hk", [(4, 1), (6, 2), (20, 1), (3, 3)])
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_interpreted_kernels_equal_the_reference_in_float64(interpret, hq, hk, splits):
    """MQA (4 and 20 query heads: a group wider than one 16-row tile's minimum), GQA and MHA over a
    ragged, left-padded, partly written cache: the literal softmax to 1e-12. 7 chunks of a run
    as short as 3 positions leave chunks empty (their log-sum-exp -inf, weight 0)."""
    torch.manual_seed(0)
    b, s, d, pos = 3, 70, 16, 60
    q, k, v = inputs(b, hq, hk, s, d, torch.float64, shared_query_layout=True)
    key_range = ragged_range(b, s, pos, [0, 9, 58])  # rows see 61, 52 and 3 keys
    got = triton_decode.launch(q, k, v, key_range[0], key_range[1], 1 / math.sqrt(d), splits=splits)
    torch.testing.assert_close(got, gold(q, k, v, key_range), rtol=1e-12, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("hq,hk", [(4, 1), (20, 1), (6, 2)])
def test_the_separate_merge_kernel_and_the_fused_merge_agree(interpret, hq, hk, monkeypatch):
    """``fused=False`` (split kernel, then the merge kernel) and the fused merge (the last chunk
    of a group merges): both the literal softmax to 1e-12, and every counter back at zero after
    the fused launch, ready for the next layer's (a counter left at one would make the next
    launch merge before its chunks are written)."""
    torch.manual_seed(4)
    b, s, d = 3, 70, 16
    q, k, v = inputs(b, hq, hk, s, d, torch.float64, shared_query_layout=True)
    key_range = ragged_range(b, s, 60, [0, 9, 58])
    want = gold(q, k, v, key_range)
    monkeypatch.setattr(triton_decode, "_COUNTERS", {})
    for fused in (False, None, None):  # the fused launch twice: the counters it left serve again
        got = launch(q, k, v, key_range[0], key_range[1], 1 / math.sqrt(d), splits=5, fused=fused)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert (q.device in triton_decode._COUNTERS) == (fused is None)  # the fused launch took counters
        assert fused is False or int(triton_decode._COUNTERS[q.device].abs().sum()) == 0


@needs_triton
def test_the_fused_merge_is_chosen_where_the_partials_fit_one_tile(interpret, monkeypatch):
    """The default fuses the merge where a group's partials (query heads x chunks x head width,
    padded to powers of two) fit :data:`FUSED_MERGE_TILE`: 64 rows of one K/V head in 4 chunks
    do; one row in 32 chunks (batch 1, where one program walking them all was slower than the
    merge kernel) does not; one chunk merges nothing."""
    asked = []
    monkeypatch.setattr(triton_decode, "_counters", lambda device, groups: asked.append(groups))
    for hq, splits, fuses in ((9, 4, True), (32, 4, True), (9, 32, False), (9, 1, False)):
        q, k, v = inputs(2, hq, 1, 40, 64, torch.float64)
        key_range = ragged_range(2, 40, 39, [0, 3])
        launch(q, k, v, key_range[0], key_range[1], 0.125, splits=splits)
        assert (len(asked) == 1) == fuses, (hq, splits)
        asked.clear()


def test_counters_grow_and_stay_per_device(monkeypatch):
    """One zeroed buffer a device, grown for more groups and reused otherwise."""
    monkeypatch.setattr(triton_decode, "_COUNTERS", {})
    cpu = torch.device("cpu")
    first = triton_decode._counters(cpu, 10)
    assert first.dtype == torch.int32 and first.numel() >= 10 and not first.any()
    assert triton_decode._counters(cpu, 1000) is first
    grown = triton_decode._counters(cpu, 5000)
    assert grown.numel() >= 5000 and grown is not first and triton_decode._counters(cpu, 7) is grown


@needs_triton
def test_interpreted_kernels_with_a_wide_head_and_an_odd_width(interpret):
    """A head width that is no power of two (48: the tile is masked to it) and a scale given."""
    torch.manual_seed(1)
    q, k, v = inputs(2, 8, 2, 40, 48, torch.float64)
    key_range = ragged_range(2, 40, 39, [5, 0])
    got = triton_decode.launch(q, k, v, key_range[0], key_range[1], 0.3, splits=2)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=range_mask(key_range, 40),
                                                            enable_gqa=True, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 2e-3)])
def test_interpreted_kernels_in_float32_and_float16(interpret, dtype, tol):
    """float32 (IEEE products, no TF32) and float16 against the float64 reference, within a few
    units of their rounding (float16 rounds the probabilities before the product with V);
    bfloat16 products are not emulated correctly by this Triton's interpreter, so bf16 runs on
    the GPU only."""
    torch.manual_seed(2)
    q, k, v = inputs(2, 6, 2, 50, 16, dtype)
    key_range = ragged_range(2, 50, 45, [3, 30])
    got = triton_decode.launch(q, k, v, key_range[0], key_range[1], 0.25, splits=3)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), gold(q, k, v, key_range), rtol=tol, atol=tol)  # scale 1/sqrt(16)


@needs_triton
def test_a_dense_mask_is_read_as_its_run(interpret):
    """Called with the dense mask a layer builds instead of a key range: the same numbers."""
    torch.manual_seed(3)
    q, k, v = inputs(3, 4, 1, 24, 16, torch.float64)
    key_mask = torch.ones(3, 24, dtype=torch.bool)
    key_mask[0, :4] = False
    key_mask[2, :11] = False
    token = torch.zeros(3, 1, dtype=torch.long)
    dense = masks.self_attention_mask(token, key_mask, start=torch.tensor(17), keys=24).dense
    key_range = masks.self_attention_mask(token, key_mask, start=torch.tensor(17), keys=24,
                                          plan=DecodePlan.of("split-k-decode")).key_range
    by_mask = attend(q, k, v, AttentionMask(dense=dense), kernel="split-k-decode")
    by_range = attend(q, k, v, AttentionMask(key_range=key_range), kernel="split-k-decode")
    assert torch.equal(by_mask, by_range)
    torch.testing.assert_close(by_range, gold(q, k, v, key_range), rtol=1e-12, atol=1e-12)


def factored(b, hq, hk, s, d, dtype, add):
    """A :class:`~mhe.attention.kernels.FactoredQuery` of MHE under rotary positions (one shared
    query a row, per-head factors near 1 or offsets near 0) and a cache ``k, v``."""
    shared, k, v = inputs(b, 1, hk, s, d, dtype)
    f = torch.randn(hq, d, dtype=dtype) * 0.5 + (0.0 if add else 1.0)
    return kernels.FactoredQuery(shared, f, add=add), k, v


@needs_triton
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("splits", [1, 3])
def test_factors_applied_in_the_kernel_equal_the_heads_made_first(interpret, add, dtype, splits):
    """MHE-Mul's factors (MHE-Add's offsets) applied as the kernel loads the one shared query:
    the same numbers as the heads made first and handed to the kernel (the unfused path), to the
    bit (the product is rounded to the query's dtype as torch's is), and the literal softmax over
    those heads to 1e-12 in float64; 9 query heads over one K/V head, ragged rows."""
    torch.manual_seed(3)
    b, s, d = 3, 50, 16
    fq, k, v = factored(b, 9, 1, s, d, dtype, add)
    key_range = ragged_range(b, s, 40, [0, 7, 38])
    heads = fq.heads()
    got = launch(fq.shared, k, v, key_range[0], key_range[1], 1 / math.sqrt(d), splits=splits, factors=fq.factors,
                 add=add)
    assert torch.equal(got, launch(heads, k, v, key_range[0], key_range[1], 1 / math.sqrt(d), splits=splits))
    if dtype == torch.float64:
        torch.testing.assert_close(got, gold(heads, k, v, key_range), rtol=1e-12, atol=1e-12)


@needs_triton
def test_a_factored_query_reaches_the_kernel_and_other_kernels_get_its_heads(interpret, monkeypatch):
    """``attend`` hands a factored query to ``split-k-decode`` whole (its factors reach the launch)
    and makes the heads for a kernel that reads none (``sdpa``); both give the heads' numbers.
    With :data:`~mhe.attention.triton_decode.FACTORS_IN_KERNEL` off the heads are made first."""
    torch.manual_seed(5)
    fq, k, v = factored(2, 6, 1, 30, 16, torch.float64, add=False)
    key_range = ragged_range(2, 30, 20, [0, 6])
    mask = AttentionMask(key_range=key_range[:2])
    seen = []
    monkeypatch.setattr(triton_decode, "launch", lambda *a, **kw: seen.append(kw.get("factors")) or launch(*a, **kw))
    got = attend(fq, k, v, mask, kernel="split-k-decode")
    assert seen[-1] is fq.factors
    want = attend(fq.heads(), k, v, AttentionMask(dense=range_mask(key_range, 30)), kernel="sdpa")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attend(fq, k, v, AttentionMask(dense=range_mask(key_range, 30)), kernel="sdpa"), want,
                               rtol=0, atol=0)
    monkeypatch.setattr(triton_decode, "FACTORS_IN_KERNEL", False)
    assert torch.equal(attend(fq, k, v, mask, kernel="split-k-decode"), got) and seen[-1] is None


@needs_triton
def test_compiled_factored_call_is_one_operator_with_the_eager_numbers(interpret):
    """A factored query through ``mhe::split_k_decode`` (its factors and offset flag as the
    operator's arguments) inside torch.compile, whole graph: the eager call's numbers."""
    torch.manual_seed(6)
    fq, k, v = factored(2, 4, 1, 30, 16, torch.float64, add=True)
    key_range = ragged_range(2, 30, 20, [0, 6])

    def step(shared, factors, k, v, offsets, used):
        q = kernels.FactoredQuery(shared, factors, add=True)
        return attend(q, k, v, AttentionMask(key_range=(offsets, used)), kernel="split-k-decode") * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = (fq.shared, fq.factors, k, v, *key_range[:2])
    assert torch.equal(compiled(*args), step(*args))
    torch._dynamo.reset()


@needs_triton
def test_compiled_call_is_one_operator_with_the_eager_numbers(interpret):
    """Inside torch.compile the launch is the ``mhe::split_k_decode`` operator (traced through its
    fake implementation, no graph break) and returns the eager call's numbers."""
    torch.manual_seed(4)
    q, k, v = inputs(2, 4, 2, 30, 16, torch.float64)
    key_range = ragged_range(2, 30, 20, [0, 6])

    def step(q, k, v, offsets, used):
        return attend(q, k, v, AttentionMask(key_range=(offsets, used)), kernel="split-k-decode") * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(q, k, v, *key_range[:2]), step(q, k, v, *key_range[:2]))
    torch._dynamo.reset()


@pytest.mark.parametrize("t", [1, 3])
def test_fallback_outside_the_interpreter_is_sdpa_exactly(t, monkeypatch):
    """A CPU tensor outside Triton's interpreter (or several query tokens) runs sdpa unchanged."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = inputs(2, 4, 2, 10, 8, torch.float32)
    q = q.expand(-1, -1, t, -1)
    key_mask = torch.ones(2, 10, dtype=torch.bool)
    key_mask[1, :4] = False
    tokens = torch.zeros(2, t, dtype=torch.long)
    mask = masks.self_attention_mask(tokens, key_mask, start=torch.tensor(5), keys=10).dense
    assert not triton_decode.fast_path(q, k, v, mask, False, 0.0)
    assert torch.equal(attend(q, k, v, AttentionMask(dense=mask), kernel="split-k-decode"), attend(q, k, v, AttentionMask(dense=mask), kernel="sdpa"))
    if t == 1:
        kr = masks.self_attention_mask(tokens, key_mask, start=torch.tensor(5), keys=10,
                                       plan=DecodePlan.of("split-k-decode")).key_range
        assert torch.equal(kr[0], key_offsets(torch.tensor([0, 4], dtype=torch.int32), 10))
        assert torch.equal(attend(q, k, v, AttentionMask(key_range=kr), kernel="split-k-decode"),
                           attend(q, k, v, AttentionMask(dense=mask), kernel="sdpa"))


@needs_triton
def test_autograd_and_dropout_keep_sdpa(interpret):
    q, k, v = inputs(1, 4, 1, 8, 16, torch.float64)
    assert triton_decode.fast_path(q, k, v, None, False, 0.0)
    assert not triton_decode.fast_path(q.requires_grad_(), k, v, None, False, 0.0)  # no backward here
    assert not triton_decode.fast_path(q.detach(), k, v, None, False, 0.1)  # dropout


@pytest.mark.parametrize("kind,opts,chosen", [("mqa", {}, True), ("sha", {}, True), ("mhe-mul", {}, True),
                                              ("gqa", {"n_kv_heads": 2}, True), ("mha", {}, False), ("skv", {}, False)])
def test_policy_chooses_split_k_decode_where_triton_is(kind, opts, chosen, monkeypatch):
    """With Triton, every cache with fewer K/V heads than query heads (or one) decodes through
    ``split-k-decode`` on CUDA, fp32 and one short row included (it measured faster at batch 1
    than cuDNN through ``sdpa-expand`` or over grouped rows). Without Triton the policy is as
    before (``test_flash_decode.py``): one short row of one K/V head takes ``sdpa-expand``. MHA
    takes the kernel at batch 1 in half precision only (measured faster there than cuDNN's)."""
    monkeypatch.setattr(triton_decode, "available", lambda: True)
    monkeypatch.setattr(kernels, "_cudnn_attention", lambda device: True)  # no card here
    attn = build_attention(kind, d_model=32, n_heads=4, **opts)
    want = "split-k-decode" if chosen else "sdpa"
    assert decode_kernel(attn, CUDA, torch.bfloat16, batch=8, positions=4096) == want
    assert decode_kernel(attn, CUDA, torch.float32) == (want if chosen else "eager-one-token")
    assert decode_kernel(attn, torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert decode_kernel(attn, CUDA, torch.bfloat16, requested="flash-decode") == "flash-decode"
    short = decode_kernel(attn, CUDA, torch.bfloat16, batch=1, positions=EXPAND_MAX_POSITIONS)
    assert short == "split-k-decode"  # MHA too: one row's heads are few tiles for cuDNN
    assert decode_kernel(attn, CUDA, torch.bfloat16, batch=1, positions=4096) == "split-k-decode"
    assert decode_kernel(attn, CUDA, torch.float32, batch=1, positions=64) == (want if chosen else "eager-one-token")
    assert decode_kernel(attn.double(), CUDA, torch.float64, batch=1, positions=64) == (want if chosen else "sdpa")
    assert decode_kernel(attn, CUDA, torch.bfloat16, batch=2, positions=64) == want
    monkeypatch.setattr(triton_decode, "available", lambda: False)
    assert decode_kernel(attn, CUDA, torch.bfloat16, batch=1, positions=EXPAND_MAX_POSITIONS) == (
        "sdpa-expand" if attn.cache_heads == 1 else "sdpa")
    assert decode_kernel(attn, CUDA, torch.bfloat16, batch=8, positions=4096) == (
        "flash-decode" if attn.cache_heads == 1 else "sdpa")


SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)
MODELS = [("tiny-decoder", "mqa", {}), ("tiny-decoder", "gqa", {"n_kv_heads": 2}), ("tiny-decoder", "mhe-mul", {}),
          ("llama-tiny", "mhe-mul", {}), ("llama-tiny", "gqa", {"n_kv_heads": 2}), ("llama-tiny", "mha", {})]


@needs_triton
@pytest.mark.parametrize("name,kind,opts", MODELS)
def test_generation_through_the_kernel_equals_sdpa_in_float64(interpret, name, kind, opts, monkeypatch):
    """``model.generate`` with every decode step's attention in the interpreted kernels: the
    logits of sdpa decoding to 1e-12 and the same greedy tokens, for ragged left-padded prompts
    (MHE-Mul folded to MQA on the GPT-2-style model; under rotary positions, its per-head
    factors applied to the rotated query over one cached head)."""
    torch.manual_seed(0)
    model = build_model(name, attention=kind, attn_options=opts or None, **SMALL).double().eval()
    ids = torch.randint(3, 99, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :5] = 0
    want, lw = model.generate(ids, 5, attention_mask=mask, kernel="sdpa", return_logits=True)
    launches = []
    monkeypatch.setattr(triton_decode, "launch",
                        lambda *a, **kw: launches.append(kw.get("factors") is not None) or launch(*a, **kw))
    session = model.generator(3, 12, kernel="split-k-decode")
    got, lg = model.generate(ids, 5, attention_mask=mask, session=session, return_logits=True)
    assert session.plan.kernel == "split-k-decode" and len(launches) == 2 * 4  # 2 layers, 4 steps
    # MHE under rotary positions: its factors applied inside the kernel (kernels.FactoredQuery)
    assert set(launches) == {name == "llama-tiny" and kind == "mhe-mul"}
    assert {c.k.shape[1] for c in session.caches} == {{"gqa": 2, "mha": 4}.get(kind, 1)}
    torch.testing.assert_close(lg, lw, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, want)


@needs_triton
def test_beam_search_through_the_kernel_equals_sdpa_in_float64(interpret, monkeypatch):
    """Beam search with every attention configured ``split-k-decode``: decoder self-attention over
    the searched window of its cache (key ranges) and cross-attention over right-padded sources
    (the dense mask read as a run) in the interpreted kernels; the encoder's whole-sequence
    attention runs sdpa. The hypotheses and scores of the sdpa model, to 1e-12."""
    from mhe.generation.beam import beam_search

    torch.manual_seed(0)
    settings = dict(SMALL, attention="gqa", attn_options={"n_kv_heads": 2})
    want_model = build_model("tiny-encoder-decoder", **settings).double().eval()
    model = build_model("tiny-encoder-decoder", attn_kernel="split-k-decode", **settings).double()
    model.load_state_dict(want_model.state_dict())
    model.eval()
    src = torch.randint(3, 99, (2, 6))
    smask = torch.ones(2, 6, dtype=torch.bool)
    smask[1, 4:] = False
    launches = []
    monkeypatch.setattr(triton_decode, "launch", lambda *a, **kw: launches.append(1) or launch(*a, **kw))
    got, sg = beam_search(model, src, smask, bos_id=1, eos_id=2, beam=3, max_len=5, step_mode="eager",
                          return_scores=True)
    assert len(launches) > 0
    want, sw = beam_search(want_model, src, smask, bos_id=1, eos_id=2, beam=3, max_len=5, step_mode="eager",
                           return_scores=True)
    assert torch.equal(got, want)
    torch.testing.assert_close(sg, sw, rtol=1e-12, atol=1e-12)


@needs_triton
def test_compiled_step_builds_the_key_range_once_for_every_layer(interpret):
    """Inside a compiled decode step the key range is one ``mhe::decode_key_range`` operator a
    forward, read by every layer's kernel (built as plain tensor code, inductor recomputed it in
    each layer: two kernels a layer), and the step's logits stay the eager ones (float64)."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    torch.manual_seed(1)
    model = build_model("llama-tiny", attention="gqa", attn_options={"n_kv_heads": 2}, **SMALL).double().eval()
    ids = torch.randint(3, 99, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[2, :3] = 0
    want, lw = model.generate(ids, 4, attention_mask=mask, kernel="split-k-decode", return_logits=True)
    torch._dynamo.reset()
    session = model.generator(3, 12, kernel="split-k-decode", step_mode="compile",
                              compile_options={"backend": recording})
    got, lg = model.generate(ids, 4, attention_mask=mask, session=session, return_logits=True)
    torch._dynamo.reset()
    calls = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert sum("split_k_decode" in c for c in calls) == SMALL["n_layers"]
    assert sum("decode_key_range" in c for c in calls) == 1
    torch.testing.assert_close(lg, lw, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, want)
