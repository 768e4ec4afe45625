"""Beam search over large batches: a source's translation does not depend on its batch, the
search stops when every hypothesis has finished, and a batch whose sources are mostly done goes
on in a smaller session with the same answer; the decoding options of the translation task."""

import copy

import pytest
import torch

from mhe.attention import masks
from mhe.attention.kernels import decode_kernel
from mhe.data.tokenize import train_tokenizer
from mhe.errors import MheError
from mhe.models import build_model
from mhe.generation.beam import BeamSearcher, beam_search
from mhe.tasks.translation import TranslationTask, decode_batches
from reference import beam_search_uncached

EOS = 2


def ending_model(dtype=torch.float64, vocab=99):
    """A random tiny encoder-decoder whose hypotheses end after 0 to about 15 tokens (EOS reads
    one unit of the last layer's output, which that layer's norm shifts up)."""
    torch.manual_seed(0)
    model = build_model("tiny-encoder-decoder", attention="mha", vocab_size=vocab, d_model=32, n_heads=4, d_ff=64,
                        n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)
    with torch.no_grad():
        model.lm_head.weight[EOS, 0] = 2.5
        model.decoder_layers[-1].ffn_norm.bias[0] = 1.5
    return model.to(dtype).eval()


def sources():
    src = torch.randint(3, 99, (16, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(src, dtype=torch.bool)
    for i in range(16):
        mask[i, 3 + i % 6:] = False
    return src, mask


def search(model, src, mask, **kw):
    return beam_search(model, src, mask, bos_id=1, eos_id=EOS, beam=3, max_len=40, return_scores=True, **kw)


def search_uncached(model, src, mask):
    return beam_search_uncached(model, src, mask, bos_id=1, eos_id=EOS, beam=3, max_len=40, return_scores=True)


def test_mostly_finished_batch_moves_to_a_smaller_session_with_the_same_answer():
    model = ending_model()
    src, mask = sources()
    searcher = BeamSearcher(model)
    got, got_scores = search(model, src, mask, searcher=searcher)
    sizes = sorted(k[0] for k in searcher.sessions)
    assert sizes == [4, 16]  # the last sources went on in a session of 4
    lengths = ((got[:, 1:] != EOS).cumprod(1)).sum(1)
    assert lengths.max() < 39 and got.shape[1] == lengths.max() + 2  # stopped when every hypothesis ended
    assert lengths.min() < lengths.max()
    want, want_scores = search_uncached(model, src, mask)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_scores, want_scores, rtol=1e-12, atol=1e-12)


def test_translation_does_not_depend_on_the_batch_fp32():
    """fp32, as translation runs: each source alone, in two other batches and in the whole batch
    (different padding, session sizes and stopping steps) gives the same tokens and scores."""
    model = ending_model(torch.float32)
    src, mask = sources()
    whole, whole_scores = search(model, src, mask)
    for lo, hi in ((0, 5), (5, 16)):
        width = int(mask[lo:hi].sum(1).max())
        part, part_scores = search(copy.deepcopy(model), src[lo:hi, :width], mask[lo:hi, :width])
        assert torch.equal(part, whole[lo:hi, :part.shape[1]])
        assert (whole[lo:hi, part.shape[1]:] == EOS).all()
        torch.testing.assert_close(part_scores, whole_scores[lo:hi], rtol=1e-6, atol=1e-6)
    for i in range(0, 16, 3):
        n = int(mask[i].sum())
        alone, alone_score = search(model, src[i:i + 1, :n], None)
        assert torch.equal(alone[0], whole[i, :alone.shape[1]])
        torch.testing.assert_close(alone_score, whole_scores[i:i + 1], rtol=1e-6, atol=1e-6)


def test_windowed_cache_step_equals_the_whole_buffer():
    torch.manual_seed(2)
    model = ending_model()
    layer = model.decoder_layers[0].self_attn
    x = torch.randn(3, 5, 32, dtype=torch.float64)
    caches = [layer.new_cache(3, 24, dtype=torch.float64) for _ in range(2)]
    window = [None, 16]  # the whole buffer (the sublayer's own mask), or a window of its first 16 positions

    def step(x_t, cache, keys):
        mask = None if keys is None else masks.self_attention_mask(x_t, None, start=cache.index, keys=keys)
        return layer(x_t, mask=mask, cache=cache)
    outs = [torch.cat([step(x[:, i:i + 1], c, w) for i in range(5)], 1) for c, w in zip(caches, window)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)
    narrow = masks.self_attention_mask(x[:, :1], None, start=caches[1].index, keys=16)
    assert narrow.keys == 16 and narrow.dense.shape[-1] == 16  # it reads 16 positions of 24
    small = layer.new_cache(1, 8, dtype=torch.float64)
    small.update(torch.zeros(1, 4, 2, 8, dtype=torch.float64), torch.zeros(1, 4, 2, 8, dtype=torch.float64))
    with pytest.raises(MheError, match="window 2 too small"):
        masks.self_attention_mask(x[:1, :1], None, start=small.index, keys=2)


def test_fp32_cuda_decoding_picks_the_explicit_one_token_kernel():
    model = ending_model(torch.float32)
    assert decode_kernel(model, "cuda", torch.float32) == "eager-one-token"
    assert decode_kernel(model, "cuda", torch.bfloat16) == "sdpa"  # the configured kernel, kept
    assert decode_kernel(model, "cpu", torch.float32) == "sdpa"


def test_decode_batches_respect_sentences_and_budget():
    lengths = [3, 40, 5, 7, 33, 2, 9, 12] * 5
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches = decode_batches(lengths, order, sentences=8, beam=4, max_len=100, max_tokens=4 * 6 * 132)
    assert [i for b in batches for i in b] == order
    for b in batches:
        width = -(-max(lengths[i] for i in b) // 32) * 32 + 100
        assert len(b) <= 8 and (len(b) * 4 * width <= 4 * 6 * 132 or len(b) == 1)
    assert [len(b) for b in batches] == [6] * 5 + [4, 4, 2]  # 30 sources of <= 32 tokens, then 10 longer


def translation_task():
    texts = ["a man rides a bike .", "two dogs play in the snow .", "a girl reads a book ."] * 5
    task = TranslationTask()
    task.tok = train_tokenizer("bpe", texts, 99)
    model = ending_model(torch.float32, task.tok.get_vocab_size())
    task.o = {"beam": 3, "alpha": 0.6, "eval_batch": 64, "decode_tokens": 1 << 20, "decode_dtype": "float32"}
    task.bos, task.eos, task.pad = (task.tok.token_to_id(t) for t in ("[BOS]", "[EOS]", "[PAD]"))
    task.max_len = model.cfg.max_len
    return model, task, texts[:3] + ["a dog .", "", "the snow ."]


def test_translate_batches_and_dtype_option():
    model, task, lines = translation_task()
    whole = task.translate(model, lines)
    task.o["eval_batch"] = 2
    assert task.translate(model, lines) == whole  # batches of 2: the same translations
    assert whole[4] == ""
    bf16 = task.translate(model, lines, dtype="bfloat16")
    assert len(bf16) == len(lines) and bf16[4] == ""
    assert next(model.parameters()).dtype == torch.float32  # a bf16 copy decoded; the model is untouched
    with pytest.raises(MheError, match="decoding dtype must be one of float32, bfloat16, got 'float16'"):
        task.translate(model, lines, dtype="float16")
