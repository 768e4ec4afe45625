"""The three architectures: shapes, masks, heads, and cached decoding for every kind."""

import pytest
import torch

from mhe.attention import KINDS, attention_class
from mhe.errors import MheError
from mhe.models import ModelConfig, build_model, preset
from reference import generate_uncached, seq2seq_greedy

CACHE_KINDS = [k for k in KINDS if attention_class(k).supports_cache]
SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=32)


def small(name, kind, **kw):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    return build_model(name, attention=kind, attn_options=opts, **{**SMALL, **kw}).double().eval()


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_decoder_cached_logits_equal_full_forward(kind):
    model = small("tiny-decoder", kind)
    ids = torch.randint(0, 99, (2, 9))
    full = model(ids).logits
    caches = model.new_caches(2, 9)
    parts = [model(ids[:, :4], caches=caches).logits] + [model(ids[:, t:t + 1], caches=caches).logits
                                                         for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_decoder_generate_cached_equals_uncached(kind):
    model = small("tiny-decoder", kind)
    prompt = torch.randint(0, 99, (2, 3))
    assert torch.equal(model.generate(prompt, 8), generate_uncached(model, prompt, 8))


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_seq2seq_cached_greedy_equals_uncached(kind):
    model = small("tiny-encoder-decoder", kind)
    src = torch.randint(3, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 4:] = False
    a = seq2seq_greedy(model, src, mask, bos_id=1, eos_id=2, max_len=10, use_cache=True)
    b = seq2seq_greedy(model, src, mask, bos_id=1, eos_id=2, max_len=10, use_cache=False)
    assert torch.equal(a, b)


def test_seq2seq_teacher_forcing_equals_cached_decode():
    model = small("tiny-encoder-decoder", "mhe-mul")
    src, tgt = torch.randint(3, 99, (2, 6)), torch.randint(3, 99, (2, 5))
    full = model(src, tgt).logits
    memory = model.encode(src)
    caches = model.new_caches(2, 5)
    steps = [model.decode(tgt[:, t:t + 1], memory, caches=caches) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("kind", KINDS)
def test_encoder_padding_does_not_change_real_tokens(kind):
    model = small("tiny-encoder", kind, head="classification")
    ids = torch.randint(1, 99, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[:, 6:] = 0
    other = ids.clone()
    other[:, 6:] = torch.randint(1, 99, (2, 2))
    a = model(ids, mask).logits
    b = model(other, mask).logits
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_heads_and_losses():
    ids = torch.randint(0, 99, (2, 8))
    mlm = small("tiny-encoder", "mhe-mul")
    labels = torch.full_like(ids, -100)
    labels[:, 2] = ids[:, 2]
    out = mlm(ids, labels=labels)
    assert out.logits.shape == (2, 8, 99) and out.loss.item() > 0
    assert mlm.decoder.weight is mlm.encoder.embed.tokens.weight  # tied
    reg = small("tiny-encoder", "mha", head="classification", num_labels=1)
    assert reg(ids, labels=torch.randn(2)).logits.shape == (2, 1)
    qa = small("tiny-encoder", "mqa", head="qa")
    out = qa(ids, start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))
    assert out.logits.shape == (2, 8, 2) and out.loss.item() > 0
    lm = small("tiny-decoder", "sha")
    assert lm.lm_head.weight is lm.decoder.embed.tokens.weight
    assert lm(ids, labels=ids).loss.item() > 0


def test_masked_lm_loss_equals_full_head_and_gradients():
    torch.manual_seed(0)
    model = small("tiny-encoder", "mhe-add")  # eval mode: no dropout, both paths see one network
    ids = torch.randint(0, 99, (3, 10))
    labels = torch.where(torch.rand(3, 10) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    full = model(ids, labels=labels)
    fast = model.masked_lm_loss(ids, labels)
    torch.testing.assert_close(fast.loss, full.loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fast.logits, full.logits[labels != -100], rtol=1e-12, atol=1e-12)
    g_full = torch.autograd.grad(full.loss, list(model.parameters()))
    g_fast = torch.autograd.grad(model.masked_lm_loss(ids, labels).loss, list(model.parameters()))
    for a, b in zip(g_fast, g_full):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    none = model.masked_lm_loss(ids, torch.full_like(ids, -100))  # nothing masked: zero, not NaN
    assert none.loss.item() == 0.0 and none.logits.shape == (0, 99)


def test_decoder_classification_reads_last_real_token():
    model = small("tiny-decoder", "mhe-mul", head="classification", num_labels=3)
    ids = torch.randint(1, 99, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    a = model(ids, mask).logits
    ids2 = ids.clone()
    ids2[0, 5:] = torch.randint(1, 99, (3,))  # padding after the last real token
    torch.testing.assert_close(model(ids2, mask).logits, a, rtol=1e-10, atol=1e-10)
    ids3 = ids.clone()
    ids3[0, 4] = (ids[0, 4] + 1) % 99  # the last real token matters
    assert not torch.allclose(model(ids3, mask).logits[0], a[0])


def test_every_sublayer_uses_the_kind():
    model = build_model("tiny-encoder-decoder", attention="mhe-add")
    kinds = {m.kind for m in model.modules() if hasattr(m, "kind") and m.kind}
    assert kinds == {"mhe-add"}
    n = sum(1 for m in model.modules() if getattr(m, "kind", "") == "mhe-add")
    assert n == 3 * model.cfg.n_layers


def test_presets_have_the_paper_geometry():
    assert (preset("bert-base").n_layers, preset("bert-base").d_model, preset("bert-base").n_heads) == (12, 768, 12)
    assert (preset("bert-large").n_layers, preset("bert-large").d_model, preset("bert-large").n_heads) == (24, 1024, 16)
    assert (preset("gpt2-medium").n_layers, preset("gpt2-medium").d_model) == (24, 1024)
    t = preset("transformer-base")
    assert (t.arch, t.n_layers, t.d_model, t.n_heads, t.max_len) == ("encoder-decoder", 6, 512, 8, 100)
    assert preset("bert-base").norm_first is False and preset("gpt2-base").norm_first is True


@pytest.mark.parametrize("bad, match", [
    (dict(attention="nope"), "model.attention='nope' is not allowed; model.attention takes one of mha"),
    (dict(head="lm"), "unknown head for a encoder 'lm'; valid: mlm, classification, qa"),
    (dict(colour="red"), "unknown model setting 'colour'"),
    (dict(d_model=30), "d_model=30 must be divisible by model.n_heads=4"),
])
def test_bad_model_options(bad, match):
    with pytest.raises(MheError, match=match):
        build_model("tiny-encoder", **bad)


def test_mixing_kinds_cannot_build_encoder_decoder():
    with pytest.raises(MheError, match="cannot cross-attend"):
        build_model("tiny-encoder-decoder", attention="linear")
    with pytest.raises(MheError, match="cannot be causal"):
        build_model("tiny-decoder", attention="fnet")


def test_sequence_longer_than_max_len_is_named():
    model = small("tiny-decoder", "mha")
    with pytest.raises(MheError, match="exceeds the model's max_len 32"):
        model(torch.randint(0, 99, (1, 40)))


def test_unknown_preset_lists_valid():
    with pytest.raises(MheError, match="unknown preset 'bert-small'; valid: bert-base"):
        build_model("bert-small")
    assert isinstance(preset("tiny-decoder"), ModelConfig)
