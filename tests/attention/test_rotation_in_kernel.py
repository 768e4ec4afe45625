"""The queries' rotation inside ``split-k-decode`` (``kernels.RotaryQuery``,
``kernels.ROTATION_IN_KERNEL``): each query head rotated by its row's position as the kernel loads
it, against the rotary embedding applied first (Triton's interpreter on CPU tensors, float64 and
float32), for plain and factored (MHE) queries; ``attend`` rotating first for kernels that read no
rotary query; and ``model.generate`` with the switch on against the unfused step. The GPU checks
are in ``test_split_k_decode_gpu.py``."""

import math

import pytest
import torch

from mhe.attention import kernels, triton_decode
from mhe.attention.flash_decode import range_mask
from mhe.attention.kernels import FactoredQuery, RotaryQuery, attend
from mhe.attention.masks import AttentionMask
from mhe.attention.rotary import RotaryEmbedding
from mhe.models import build_model
from test_split_k_decode import SMALL, factored, inputs, interpret, needs_triton, ragged_range  # noqa: F401

launch = triton_decode.launch


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", ["grouped", "mul", "add"])
@pytest.mark.parametrize("positions", [[9, 0, 37], [21]])
def test_the_kernel_rotates_what_the_embedding_rotates(interpret, dtype, shape, positions):
    """Rows at positions of their own (or all at one), 6 query heads over 2 K/V heads or one
    shared query with MHE-Mul's factors or MHE-Add's offsets, 3 chunks a row: the kernel's output
    equals, to the bit, the kernel's output for the query rotated first by the embedding (the
    rotation and the rounding to the query's dtype are the embedding's)."""
    torch.manual_seed(1)
    b, s, d = 3, 50, 16
    rotary = RotaryEmbedding(d, max_len=64)
    pos = torch.tensor(positions)
    key_range = ragged_range(b, s, 40, [0, 7, 38])
    if shape == "grouped":
        q, k, v = inputs(b, 6, 2, s, d, dtype)
        factors, add = None, False
    else:
        fq, k, v = factored(b, 5, 1, s, d, dtype, add=shape == "add")
        q, factors, add = fq.shared, fq.factors, fq.add
    rotated = rotary(q, pos.reshape(-1, 1).expand(b, 1))
    cos, sin = rotary.table(q.device)
    got = launch(q, k, v, key_range[0], key_range[1], 1 / math.sqrt(d), splits=3, factors=factors, add=add,
                 rotation=(cos, sin, pos))
    want = launch(rotated, k, v, key_range[0], key_range[1], 1 / math.sqrt(d), splits=3, factors=factors, add=add)
    assert torch.equal(got, want)


def rotary_query(kind: str, dtype=torch.float64, fraction: float = 1.0):
    """A :class:`RotaryQuery` (plain: 4 heads over 2; factored: MHE-Mul's), a cache and its key range."""
    torch.manual_seed(2)
    rotary = RotaryEmbedding(16, fraction=fraction, max_len=64)
    if kind == "grouped":
        q, k, v = inputs(2, 4, 2, 30, 16, dtype)
    else:
        q, k, v = factored(2, 4, 1, 30, 16, dtype, add=False)
    return RotaryQuery(q, rotary, torch.tensor([20, 11])), k, v, ragged_range(2, 30, 20, [0, 6])


@needs_triton
@pytest.mark.parametrize("kind", ["grouped", "factored"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_a_rotary_query_reaches_the_kernel_and_other_kernels_get_it_rotated(interpret, kind, fraction, monkeypatch):
    """``attend`` hands a rotary query to ``split-k-decode``, which rotates it in the kernel (the
    tables and positions reach the launch) where the whole head rotates, and first where only part
    of it does (``fraction`` 0.5); ``sdpa`` gets it rotated first. Every path gives the numbers of
    the query rotated by the embedding (to 1e-12, float64)."""
    rq, k, v, key_range = rotary_query(kind, fraction=fraction)
    seen = []
    monkeypatch.setattr(triton_decode, "launch", lambda *a, **kw: seen.append(kw.get("rotation")) or launch(*a, **kw))
    got = attend(rq, k, v, AttentionMask(key_range=key_range[:2]), kernel="split-k-decode")
    assert (seen[-1] is not None) == (fraction == 1.0)
    rotated = rq.applied()
    heads = rotated.heads() if isinstance(rotated, FactoredQuery) else rotated
    dense = AttentionMask(dense=range_mask(key_range, 30))
    want = attend(heads, k, v, dense, kernel="sdpa")
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(attend(rq, k, v, dense, kernel="sdpa"), want)


@needs_triton
def test_compiled_rotary_call_is_one_operator_with_the_eager_numbers(interpret):
    """A rotary query through ``mhe::split_k_decode`` (tables and positions as the operator's
    arguments) inside torch.compile, whole graph: the eager call's numbers."""
    rq, k, v, key_range = rotary_query("grouped")

    def step(q, k, v, offsets, used, positions):
        return attend(RotaryQuery(q, rq.rotary, positions), k, v, AttentionMask(key_range=(offsets, used)),
                      kernel="split-k-decode") * 2

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    args = (rq.query, k, v, *key_range[:2], rq.positions)
    assert torch.equal(compiled(*args), step(*args))
    torch._dynamo.reset()


STEPS = [("gqa", {"n_kv_heads": 2}, True), ("mha", {}, True), ("mqa", {}, True), ("el-att", {}, True),
         ("mhe-mul", {}, True), ("mhe-add", {}, True), ("mhe-mul", {"rope_order": "psi-then-rope"}, False),
         ("mhe-mul", {"impl": "reference"}, False)]
"""(kind, options, whether its decode steps hand the kernel a rotary query): the grouped-query family
and MHE's fast path; MHE's literal forms make their heads before the rotation."""


@needs_triton
@pytest.mark.parametrize("kind,opts,uses", STEPS)
def test_generation_with_the_rotation_in_the_kernel_equals_the_unfused_step(interpret, kind, opts, uses,
                                                                           monkeypatch):
    """``model.generate`` on a Llama-style decoder in float64 through ``split-k-decode``, ragged
    left-padded prompts: with ``ROTATION_IN_KERNEL`` every step of the kinds that rotate their
    queries last hands the kernel unrotated queries (2 layers x 4 steps), and the logits equal the
    unfused step's to 1e-12, with the same tokens."""
    torch.manual_seed(0)
    model = build_model("llama-tiny", attention=kind, attn_options=opts or None, **SMALL).double().eval()
    ids = torch.randint(3, 99, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, :2] = 0
    mask[2, :5] = 0
    monkeypatch.setattr(kernels, "ROTATION_IN_KERNEL", False)  # the unfused step, whatever the default
    want, lw = model.generate(ids, 5, attention_mask=mask, session=model.generator(3, 12, kernel="split-k-decode"),
                              return_logits=True)
    seen = []
    monkeypatch.setattr(triton_decode, "launch", lambda *a, **kw: seen.append(kw.get("rotation")) or launch(*a, **kw))
    monkeypatch.setattr(kernels, "ROTATION_IN_KERNEL", True)
    got, lg = model.generate(ids, 5, attention_mask=mask, session=model.generator(3, 12, kernel="split-k-decode"),
                             return_logits=True)
    assert sum(r is not None for r in seen) == (2 * 4 if uses else 0)
    torch.testing.assert_close(lg, lw, rtol=1e-12, atol=1e-12)
    assert torch.equal(got, want)
