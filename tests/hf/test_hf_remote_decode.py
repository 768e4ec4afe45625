"""The exported code's split decode kernel (:mod:`mhe.hf.remote.decode_mhe`): which masks count as
one run of keys a row, the offsets handed to FlashAttention-2's variable-length forward, and
``generate`` through that path. The kernel itself runs on CUDA only; here its call is replaced by
the written-out attention over the keys its arguments name, so the CPU checks what the model hands
it (float64, to 1e-12) and that the compiled step stays one graph. On the card:
tests/hf/test_hf_remote_gpu.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CompileConfig  # noqa: E402

import mhe.hf.remote.decode_mhe as decode  # noqa: E402
from mhe.hf.export import to_remote  # noqa: E402
from mhe.models import build_model  # noqa: E402
from weights_kept import perturb  # noqa: E402

SMALL = dict(vocab_size=61, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_len=24)
TOL = dict(rtol=0, atol=1e-12)


def written_out_varlen(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, causal, debug, *, scale, seqused_k):
    """FlashAttention-2's variable-length forward for one query a row over one K/V head, written
    out: row b reads keys ``cum_k[b] .. cum_k[b] + seqused_k[b]`` of the ``(B*L, 1, d)`` cache."""
    assert (max_q, dropout_p, causal, debug) == (1, 0.0, False, False) and k.shape[1] == v.shape[1] == 1
    b = q.shape[0]
    keys = k.shape[0] // b
    assert max_k == keys
    if not torch.compiler.is_compiling():  # (values: read on the host only outside a graph)
        assert cum_q.tolist() == list(range(b + 1)) and int(cum_k[-1]) == b * keys
    pos = torch.arange(keys)[None, :]
    first = cum_k[:b] - torch.arange(b, dtype=torch.int32) * keys  # [B]
    seen = (pos >= first[:, None]) & (pos < (first + seqused_k)[:, None])  # [B, L]
    scores = torch.einsum("brd,bld->brl", q, k.view(b, keys, -1)) * scale
    probs = scores.masked_fill(~seen[:, None, :], float("-inf")).softmax(-1)
    return torch.einsum("brl,bld->brd", probs, v.view(b, keys, -1)), None, None, None, None


@pytest.fixture
def split_on_cpu(monkeypatch):
    """The split path taken on the CPU in float64: every call it makes is recorded."""
    calls = []

    def op(*args, **kw):
        calls.append((args[0].shape, args[1].shape))
        return written_out_varlen(*args, **kw)

    monkeypatch.setattr(decode, "_OP", op)
    monkeypatch.setattr(decode, "VARLEN", True)
    monkeypatch.setattr(decode, "flash_capable", lambda device, dtype: True)
    monkeypatch.setattr(decode, "on_card", lambda q, k, v: q.dtype == k.dtype == v.dtype == torch.float64)
    return calls


def test_left_padded_masks():
    """2D: rows of 0s then 1s (left padding, or none) are runs that a new token extends; right
    padding or a hole is not. 4D (the last query's row): False, True up to the query, False."""
    assert decode.left_padded(None, 0)
    assert decode.left_padded(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 0)
    assert not decode.left_padded(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]]), 0)
    assert not decode.left_padded(torch.tensor([[1, 0, 1, 1]]), 0)
    row = torch.tensor([[False, True, True, True, False, False]])[:, None, None, :]
    assert decode.left_padded(row, 3)
    assert not decode.left_padded(row, 4)  # the query at 4 must see itself
    hole = torch.tensor([[True, False, True, True, False, False]])[:, None, None, :]
    assert not decode.left_padded(hole, 3)
    additive = torch.where(row, 0.0, float("-inf"))  # a float mask: 0 = attend
    assert decode.left_padded(additive, 3)


def test_key_range_offsets():
    """Row b's run begins at ``b*L + first_b`` in the ``(B*L, 1, d)`` view and holds its count of
    keys; a mask without a batch axis is every row's."""
    mask = torch.tensor([[False, True, True, False], [True, True, True, True]])[:, None, None, :]
    cum_q, cum_k, used = decode.key_range(mask, 2, 4)
    assert cum_q.tolist() == [0, 1, 2] and cum_k.tolist() == [1, 4, 8] and used.tolist() == [2, 4]
    assert all(t.dtype == torch.int32 for t in (cum_q, cum_k, used))
    _, cum_k, used = decode.key_range(mask[:1], 3, 4)
    assert cum_k.tolist() == [1, 5, 9, 12] and used.tolist() == [2, 2, 2]


def model(kind="mhe-mul"):
    return perturb(build_model("llama-tiny", attention=kind, **SMALL).double().eval())


def prompts():
    ids = torch.randint(7, 61, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("padded", [False, True], ids=["no-padding", "left-padding"])
def test_static_generate_through_the_split_kernel(split_on_cpu, padded):
    """Every decode step of every layer goes through the split kernel (its rows: the 4 query heads
    of one new token; its keys: the static cache in place), with the core ``generate``'s tokens and
    logits."""
    core = model()
    hf = to_remote(core).eval()
    ids, mask = prompts()
    if not padded:
        mask = torch.ones_like(mask)
    with torch.no_grad():
        got = hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                          output_logits=True, pad_token_id=0, cache_implementation="static")
        tokens, logits = core.generate(ids, 4, attention_mask=mask, return_logits=True)
    assert len(split_on_cpu) == 3 * SMALL["n_layers"]  # steps 2-4 (the prompt is the first)
    size = split_on_cpu[0][1][0] // 3  # the static cache's positions a row: at least the 12 tokens fed
    assert size >= 12 and all(q == (3, 4, 8) and k == (3 * size, 1, 8) for q, k in split_on_cpu)
    assert torch.equal(got.sequences, tokens)
    torch.testing.assert_close(torch.stack(got.logits, 1), logits.float(), rtol=2 ** -22, atol=0)


def test_holes_take_sdpa(split_on_cpu):
    """A prompt mask with a hole (not left padding) leaves the static cache unmarked: SDPA with the mask."""
    hf = to_remote(model()).eval()
    ids, mask = prompts()
    mask[0, 4] = 0
    with torch.no_grad():
        hf.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, cache_implementation="static",
                    pad_token_id=0)
    assert split_on_cpu == []


def test_compiled_step_through_the_split_kernel(split_on_cpu):
    """transformers' compiled decode step (dynamo's eager backend on the CPU, fullgraph: no break)
    with the split kernel gives the uncompiled tokens."""
    hf = to_remote(model()).eval()
    ids, mask = prompts()
    kw = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want = hf.generate(ids, **kw)
        config = CompileConfig(fullgraph=True, backend="eager", mode=None)
        config._compile_all_devices = True
        torch._dynamo.reset()
        split_on_cpu.clear()
        got = hf.generate(ids, compile_config=config, **kw)
    assert hasattr(hf, "_compiled_call") and torch.equal(got, want) and split_on_cpu


def test_prompt_mask_stays_2d():
    """generate hands the static cache's prompt its 2D mask (causal kernels over one K/V head) and
    each decode step transformers' fixed-shape 4D mask."""
    hf = to_remote(model()).eval()
    ids, mask = prompts()
    embeds = torch.empty(3, 9, 0, dtype=torch.float64)
    assert hf.create_masks_for_generate(config=hf.config, inputs_embeds=embeds, attention_mask=mask) is mask
