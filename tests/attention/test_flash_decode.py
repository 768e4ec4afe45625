"""The ``flash-decode`` kernel: the key ranges it reads from a static cache's masks, its
fallback to ``sdpa``, its registration, where generation chooses it, and (``-m gpu``) its
output against the literal reference and under CUDA graphs and torch.compile."""

import pytest
import torch

from mhe.attention.masks import AttentionMask
from mhe.attention import KERNELS, build_attention, kernels, masks, triton_decode
from mhe.attention.flash_decode import fast_path, key_offsets, mask_range, range_mask
from mhe.attention.folding import inference_view
from mhe.attention.kernels import EXPAND_MAX_POSITIONS, DecodePlan, attend, decode_kernel, decode_plan, view_kernels
from mhe.attention.kv_cache import KVCache
from mhe.models import build_model
from mhe.models.config import preset
from reference import softmax_attention

CUDA = torch.device("cuda")  # only its type is read on a CPU-only machine
SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)


def cache_mask(key_mask, t, start, length, *, causal, device=torch.device("cpu")):
    """The dense mask a model builds for ``t`` new queries at ``start`` over a cache of ``length``."""
    tokens = torch.zeros(key_mask.shape[0] if key_mask is not None else 1, t, dtype=torch.long, device=device)
    return masks.self_attention_mask(tokens, key_mask, causal=causal, start=start, keys=length).dense


def run_of(start: torch.Tensor, used: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, S]``: True exactly on ``start_b .. start_b + used_b - 1`` (the run the kernel reads)."""
    pos = torch.arange(length)[None, :]
    return (pos >= start[:, None].long()) & (pos < (start + used)[:, None].long())


def check_contiguous_range(mask: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's precondition, asserted: every row's allowed keys are the run read from it."""
    s = mask.shape[-1]
    start, used = mask_range(mask, batch, s, device=mask.device)
    assert start.dtype == used.dtype == torch.int32 and start.shape == used.shape == (batch,)
    assert torch.equal(run_of(start, used, s), mask.reshape(-1, s).expand(batch, s))
    return start, used


def test_range_of_a_left_padded_causal_decode_mask():
    length, pos = 12, 7  # the new token sits at position 7 of a 12-slot cache
    key_mask = torch.ones(3, length, dtype=torch.bool)
    key_mask[0, :3] = False  # rows of different lengths: padding 3, 0 and 6
    key_mask[2, :6] = False
    mask = cache_mask(key_mask, 1, torch.tensor(pos), length, causal=True, device=torch.device("cpu"))
    start, used = check_contiguous_range(mask, 3)
    assert start.tolist() == [3, 0, 6] and used.tolist() == [5, 8, 2]


def test_range_of_a_partially_filled_cache_without_padding():
    mask = cache_mask(None, 1, torch.tensor(4), 10, causal=True, device=torch.device("cpu"))  # [1, 1, 1, 10]
    start, used = check_contiguous_range(mask, 2)  # one mask row broadcast over the batch
    assert start.tolist() == [0, 0] and used.tolist() == [5, 5]
    mask = cache_mask(None, 1, torch.tensor(4), 10, causal=False, device=torch.device("cpu"))  # written so far
    assert mask_range(mask, 2, 10, device=torch.device("cpu"))[1].tolist() == [5, 5]


def test_range_without_mask_and_key_offsets():
    start, used = mask_range(None, 3, 9, device=torch.device("cpu"))
    assert start.tolist() == [0, 0, 0] and used.tolist() == [9, 9, 9]
    offs = key_offsets(torch.tensor([2, 0, 5], dtype=torch.int32), 9)
    assert offs.dtype == torch.int32 and offs.tolist() == [2, 9, 23, 27]  # b * S + start_b, then B * S


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("eager_width", [False, True])
def test_cache_decode_range_is_the_run_of_its_mask(padded, eager_width):
    """The key range a decode step's model builds for ``flash-decode`` equals the run read from
    the dense mask it would build otherwise, and ``range_mask`` turns it back into that mask."""
    cache = KVCache(3, 1, 12, 8, dtype=torch.float32)
    cache.update(*(torch.randn(3, 1, 7, 8) for _ in range(2)))  # a prompt of 7; the new token goes at 7
    key_mask = None
    if padded:
        key_mask = torch.ones(3, 8 if eager_width else 12, dtype=torch.bool)  # [B, start + 1] or [B, L]
        key_mask[0, :3] = False
        key_mask[2, :6] = False
    token = torch.zeros(3, 1, dtype=torch.long)
    mask = masks.self_attention_mask(token, key_mask, start=cache.index, keys=12).dense
    begin, used = check_contiguous_range(mask, 3)
    offsets, got_used, queries = masks.self_attention_mask(token, key_mask, start=cache.index, keys=12,
                                                           plan=DecodePlan.of("flash-decode")).key_range
    assert offsets.dtype == got_used.dtype == queries.dtype == torch.int32
    assert queries.tolist() == [0, 1, 2, 3]  # cum_seq_q: one query a row, built once for every layer
    assert torch.equal(got_used, used) and torch.equal(offsets, key_offsets(begin, 12))
    assert torch.equal(range_mask((offsets, got_used), 12), mask.expand(3, 1, 1, 12))


def test_a_mask_with_a_hole_is_not_a_run():
    """Why the precondition matters: a hole makes the run differ from the mask."""
    mask = torch.tensor([[True, False, True, True]])[:, None, None, :]
    start, used = mask_range(mask, 1, 4, device=torch.device("cpu"))
    assert not torch.equal(run_of(start, used, 4), mask.reshape(1, 4))


@pytest.mark.parametrize("t", [1, 3])
def test_fallback_is_sdpa_exactly_on_cpu(t):
    q = torch.randn(2, 4, t, 8)
    k, v = torch.randn(2, 1, 10, 8), torch.randn(2, 1, 10, 8)
    key_mask = torch.ones(2, 10, dtype=torch.bool)
    key_mask[1, :4] = False
    mask = cache_mask(key_mask, t, torch.tensor(5), 10, causal=True, device=torch.device("cpu"))
    assert not fast_path(q, k, v, mask, False, 0.0)  # a CPU tensor never takes the fast path
    want = attend(q, k, v, AttentionMask(dense=mask), kernel="sdpa")
    assert torch.equal(attend(q, k, v, AttentionMask(dense=mask), kernel="flash-decode"), want)
    gold = softmax_attention(q[:, 0].double(), k[:, 0].double(), v[:, 0].double(), key_mask=mask[:, 0, -1])
    torch.testing.assert_close(want[:, 0, -1].double(), gold[:, -1], rtol=1e-5, atol=1e-6)


def test_kernel_is_registered_and_configurable():
    assert "flash-decode" in KERNELS
    assert build_attention("mqa", d_model=32, n_heads=4, kernel="flash-decode").cfg.kernel == "flash-decode"
    cfg = preset("tiny-decoder").replace(attn_kernel="flash-decode", **SMALL)
    model = build_model(cfg)
    assert view_kernels(model) == "flash-decode"


@pytest.mark.parametrize("kind,heads", [("mqa", 1), ("sha", 1), ("mhe-mul", 1), ("mha", 4), ("gqa", 2)])
def test_decode_kernel_is_flash_decode_only_on_cuda_for_one_kv_head(kind, heads, monkeypatch):
    monkeypatch.setattr(kernels, "_cudnn_attention", lambda device: True)  # no card here
    monkeypatch.setattr(triton_decode, "available", lambda: False)  # with Triton: test_split_k_decode.py
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    attn = build_attention(kind, d_model=32, n_heads=4, **opts)
    assert attn.cache_heads == heads  # fast MHE caches one K/V head
    assert decode_kernel(attn, CUDA, torch.bfloat16) == ("flash-decode" if heads == 1 else "sdpa")
    assert decode_kernel(attn, torch.device("cpu"), torch.bfloat16) == "sdpa"
    assert decode_kernel(attn, CUDA, requested="matmul-decode") == "matmul-decode"  # the caller's choice wins
    assert decode_kernel(attn, CUDA, torch.float32) == "eager-one-token"  # no fast fp32 one-query SDPA
    one_row = decode_kernel(attn, CUDA, torch.bfloat16, batch=1, positions=EXPAND_MAX_POSITIONS)
    assert one_row == ("sdpa-expand" if heads == 1 else "sdpa")  # one cuDNN kernel, not split-K's two
    long_row = decode_kernel(attn, CUDA, torch.bfloat16, batch=1, positions=EXPAND_MAX_POSITIONS + 1)
    assert long_row == decode_kernel(attn, CUDA, torch.bfloat16, batch=2, positions=64)
    assert long_row == ("flash-decode" if heads == 1 else "sdpa")
    monkeypatch.setattr(kernels, "_cudnn_attention", lambda device: False)  # an older card, or cuDNN off
    assert decode_kernel(attn, CUDA, torch.bfloat16, batch=1, positions=64) == ("flash-decode" if heads == 1 else "sdpa")


def test_a_configured_kernel_is_kept_and_the_model_left_unchanged(monkeypatch):
    monkeypatch.setattr(triton_decode, "available", lambda: False)
    mqa = build_attention("mqa", d_model=32, n_heads=4, kernel="sdpa-expand")
    assert decode_kernel(mqa, CUDA, torch.bfloat16) == "sdpa-expand"
    model = build_model("tiny-decoder", attention="mqa", **SMALL)
    assert decode_plan(model, CUDA, torch.bfloat16) == DecodePlan("flash-decode", "key-range")
    assert inference_view(model) is model and view_kernels(model) == "sdpa"  # the plan is written into no sublayer


@pytest.mark.parametrize("padded", [False, True])
def test_generate_with_flash_decode_on_cpu_equals_sdpa(padded):
    """On a CPU the kernel's range path rebuilds the mask and runs sdpa: identical output."""
    model = build_model("tiny-decoder", attention="mhe-mul", **SMALL).double().eval()
    ids = torch.randint(3, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0 if padded else 1
    a, la = model.generate(ids, 6, attention_mask=mask, kernel="sdpa", return_logits=True)
    session = model.generator(2, 12, kernel="flash-decode")
    b, lb = model.generate(ids, 6, attention_mask=mask, session=session, return_logits=True)
    assert session.plan.kernel == "flash-decode"
    assert torch.equal(a, b)
    # the rebuilt mask reaches SDPA by another path (float64 rounding apart where Triton is installed)
    torch.testing.assert_close(lb, la, rtol=0, atol=1e-12)


def test_fast_path_checks_compile_without_a_graph_break(monkeypatch):
    # A compiled decode step calls these checks each step; dynamo cannot trace the schema walk, and
    # a graph break there gave one graph per step on a GPU. They must fold to constants instead.
    from mhe.attention import flash_decode

    monkeypatch.setattr(flash_decode, "_capability_major", lambda index: 9)  # no card here
    torch._dynamo.reset()

    @torch.compile(fullgraph=True, backend="eager")
    def step(x):
        return x + 1 if flash_decode.varlen_has_seqused_k() and flash_decode._flash_capable(0) else x - 1

    assert torch.equal(step(torch.zeros(2)), torch.ones(2) if flash_decode._schema_has_seqused_k()
                       else -torch.ones(2))
    torch._dynamo.reset()


def test_key_range_goes_to_flash_decode_only():
    from mhe.errors import MheError

    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 1, 5, 8)
    with pytest.raises(MheError, match="key-range kernels only"):
        attend(q, k, k, AttentionMask(key_range=(torch.tensor([0, 5], dtype=torch.int32),
                                                 torch.tensor([5], dtype=torch.int32))), kernel="sdpa")


# --- on a GPU ------------------------------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_flash_decode_matches_the_reference_in_bf16():
    """Against the literal softmax in float64. Bound: FlashAttention rounds the probabilities to
    bf16 before the product with V and the output to bf16 (relative 2^-8 each), so
    |out - gold| <= 2 * 2^-8 * max|v|; SDPA's own error is the yardstick in norm."""
    torch.manual_seed(0)
    b, h, s, d = 4, 12, 1000, 64
    q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, 1, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    key_mask = torch.ones(b, s, dtype=torch.bool, device="cuda")
    for row, pad in enumerate((0, 17, 300, 999)):
        key_mask[row, :pad] = False
    mask = cache_mask(key_mask, 1, torch.tensor(700, device="cuda"), s, causal=True, device=q.device)
    assert fast_path(q, k, v, mask, False, 0.0)
    got = attend(q, k, v, AttentionMask(dense=mask), kernel="flash-decode")
    plain = attend(q, k, v, AttentionMask(dense=mask), kernel="sdpa")
    km = mask[:, 0, 0].cpu()  # [B, S]
    gold = torch.stack([softmax_attention(q[:, i].cpu().double(), k[:, 0].cpu().double(), v[:, 0].cpu().double(),
                                          key_mask=km) for i in range(h)], 1)  # [B, h, 1, d]
    bound = 2 * 2 ** -8 * v.abs().max().item()
    assert (got.cpu().double() - gold).abs().max().item() <= bound
    err = (got.cpu().double() - gold).norm() / gold.norm()
    err_sdpa = (plain.cpu().double() - gold).norm() / gold.norm()
    assert err <= 2 * err_sdpa + 1e-4, (err.item(), err_sdpa.item())


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["mqa", "mhe-mul"])
def test_graph_and_compiled_decode_equal_eager_with_flash_decode(kind):
    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention=kind, dropout=0.0, attn_dropout=0.0).cuda().bfloat16().eval()
    ids = torch.randint(0, 1024, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    for m in (None, mask):
        session = model.generator(3, 29, step_mode="eager", kernel="flash-decode")  # with Triton: split-k-decode
        a, la = model.generate(ids, 20, attention_mask=m, session=session, return_logits=True)
        assert session.plan.kernel == "flash-decode"
        s, ls = model.generate(ids, 20, attention_mask=m, step_mode="eager", kernel="sdpa", return_logits=True)
        # the first decode step (logits 1; logits 0 are the prefill's) after the same token:
        # the same function as sdpa's, in another bf16 rounding
        assert torch.equal(a[:, 9], s[:, 9])
        torch.testing.assert_close(la[:, 1].float(), ls[:, 1].float(), rtol=0.02, atol=0.05)
        g, lg = model.generate(ids, 20, attention_mask=m, return_logits=True,
                               session=model.generator(3, 29, step_mode="graph", kernel="flash-decode"))
        assert torch.equal(a, g) and torch.equal(la, lg)  # a replayed graph runs the eager kernels
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        c, lc = model.generate(ids, 20, attention_mask=m, return_logits=True, session=model.generator(
            3, 29, step_mode="compile", compile_options={"backend": "aot_eager"}, kernel="flash-decode"))
        assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == 2  # the step and the greedy choice, every step
        assert torch.equal(a, c)
        torch.testing.assert_close(lc.float(), la.float(), rtol=0.02, atol=0.05)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kind", ["mqa", "mhe-mul"])
def test_one_row_decodes_with_the_expanded_head_and_agrees_with_flash_decode(kind):
    """``sdpa-expand`` (batch 1's kernel where Triton is missing: the one K/V head expanded, not
    copied): the greedy tokens of ``flash-decode`` and logits within bf16 rounding, compiled and
    captured as users run it."""
    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention=kind, dropout=0.0, attn_dropout=0.0).cuda().bfloat16().eval()
    ids = torch.randint(0, 1024, (1, 9), device="cuda")
    session = model.generator(1, 29, kernel="sdpa-expand")
    got, lg = model.generate(ids, 20, session=session, return_logits=True)
    assert session.plan.kernel == "sdpa-expand"
    want, lw = model.generate(ids, 20, session=model.generator(1, 29, kernel="flash-decode"), return_logits=True)
    torch.testing.assert_close(lg[:, :2].float(), lw[:, :2].float(), rtol=0.02, atol=0.05)
    assert torch.equal(got[:, :10], want[:, :10])
