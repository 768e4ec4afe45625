"""The Hugging Face adapter's ``generate`` on our captured step: for what it serves (greedy and
sampled requests, static or no cache implementation, left padding, the config's end and pad
tokens) it gives transformers' own loop's tokens and ``model.generate``'s; everything else falls
through to transformers' loop."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from mhe.hf import to_hf  # noqa: E402
from mhe.models import build_model  # noqa: E402
from mhe.generation import session as generate_module  # noqa: E402

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, n_layers=2, max_len=32, dropout=0.0, attn_dropout=0.0)


def adapter(kind, **config):
    model = build_model("tiny-decoder", attention=kind, **SMALL).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)
    return model, to_hf(model, **config).eval()


def left_padded():
    ids = torch.randint(7, 99, (3, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def both(hf, ids, seed=0, **kw):
    """(fast path, transformers' loop) under the same global seed."""
    outs = []
    for fast in (True, False):
        hf.use_mhe_generate = fast
        torch.manual_seed(seed)
        outs.append(hf.generate(ids, **kw))
    hf.use_mhe_generate = True
    return outs


@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
@pytest.mark.parametrize("sample", [False, True])
def test_static_generate_equals_transformers_loop_and_model_generate(kind, sample):
    model, hf = adapter(kind)
    ids, mask = left_padded()
    options = dict(do_sample=True, temperature=0.7, top_k=30, top_p=0.85) if sample else dict(do_sample=False)
    kw = dict(attention_mask=mask, max_new_tokens=9, cache_implementation="static", pad_token_id=0, **options)
    fast, loop = both(hf, ids, **kw)
    assert fast.shape == loop.shape == (3, 15) and torch.equal(fast, loop)
    torch.manual_seed(0)  # model.generate without a seed draws from the global generator, as transformers
    ours = model.generate(ids, 9, attention_mask=mask, **options)
    assert torch.equal(fast, ours)
    again, _ = both(hf, ids, seed=1, **kw)
    assert torch.equal(again, fast) != sample  # sampling follows the seed
    assert len(generate_module._DEFAULT[model]) == 1  # one session served every call


@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
def test_end_tokens_min_new_tokens_and_the_output_dict(kind, monkeypatch):
    """The config's end token stops rows (then padded; the batch ends when every row has), min_new_tokens
    (or min_length, counting the prompt) holds it back, and return_dict_in_generate gives transformers'
    sequences and logits; the fast path serves each request."""
    model, probe = adapter(kind)
    served = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **kw: served.append(1) or generate(*a, **kw))
    ids, mask = left_padded()
    first = probe.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    end = int(first[0, 7])  # row 0's second new token (or its first, if that is the same)
    at = 6 + first[0, 6:].tolist().index(end)
    hf = to_hf(model, eos_token_id=end, pad_token_id=0).eval()
    served.clear()
    for least, hold in ((0, {"min_new_tokens": 0}), (3, {"min_new_tokens": 3}), (3, {"min_length": 6 + 3})):
        kw = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, **hold)
        fast, loop = both(hf, ids, **kw)
        assert torch.equal(fast.sequences, loop.sequences)
        assert least or (fast.sequences[0, at] == end and bool((fast.sequences[0, at + 1:] == 0).all()))
        assert bool((fast.sequences[0, 6:6 + least] != end).all())  # held back for `least` tokens
        assert len(fast.logits) == len(loop.logits) == fast.sequences.shape[1] - 6
        torch.testing.assert_close(torch.stack(fast.logits), torch.stack(loop.logits), rtol=1e-10, atol=1e-10)
        assert fast.logits[0].dtype == loop.logits[0].dtype == torch.float32
    assert len(served) == 3


def test_what_the_fast_path_does_not_serve_runs_transformers_loop(monkeypatch):
    model, hf = adapter("mhe-mul")
    ids, mask = left_padded()
    calls = []
    generate = model.generate
    monkeypatch.setattr(model, "generate", lambda *a, **kw: calls.append(1) or generate(*a, **kw))
    base = dict(max_new_tokens=4, pad_token_id=0)
    hf.generate(ids, attention_mask=mask, **base)
    hf.generate(ids, attention_mask=mask, cache_implementation="static", **base)
    assert len(calls) == 2
    right = torch.ones_like(mask)
    right[0, -2:] = 0  # right padding: transformers' business
    for kw in (dict(num_beams=2), dict(repetition_penalty=1.3), dict(cache_implementation="dynamic"),
               dict(attention_mask=right), dict(use_cache=False), dict(num_return_sequences=2, do_sample=True),
               dict(logits_processor=transformers.LogitsProcessorList([transformers.MinLengthLogitsProcessor(3, 5)]))):
        hf.generate(ids, **{"attention_mask": mask, **base, **kw})
    hf.generate(ids, **base)  # pad tokens in the prompts and no mask: transformers infers one
    assert len(calls) == 2
