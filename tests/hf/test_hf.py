"""Hugging Face interoperability (skipped when transformers is not installed)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import mhe.hf  # noqa: E402  (registers the Auto classes)
from mhe.hf import from_hf, to_hf, to_hf_tokenizer  # noqa: E402
from mhe.models import build_model  # noqa: E402
from reference import seq2seq_greedy  # noqa: E402

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, n_layers=2, max_len=32)


def core(preset, kind="mhe-mul", **kw):
    m = build_model(preset, attention=kind, **{**SMALL, **kw}).eval()
    with torch.no_grad():  # non-trivial head embeddings
        for mod in m.modules():
            if hasattr(mod, "head_embed"):
                mod.head_embed.normal_(0, 0.5)
    return m


CASES = [("tiny-encoder", {}, transformers.AutoModelForMaskedLM),
         ("tiny-encoder", {"head": "classification", "num_labels": 3}, transformers.AutoModelForSequenceClassification),
         ("tiny-encoder", {"head": "qa"}, transformers.AutoModelForQuestionAnswering),
         ("tiny-decoder", {}, transformers.AutoModelForCausalLM),
         ("tiny-decoder", {"head": "classification"}, transformers.AutoModelForSequenceClassification),
         ("tiny-encoder-decoder", {}, transformers.AutoModelForSeq2SeqLM)]


def inputs(arch):
    ids = torch.randint(7, 99, (2, 6))
    if arch == "encoder-decoder":
        return {"input_ids": ids, "decoder_input_ids": torch.randint(7, 99, (2, 4))}
    return {"input_ids": ids}


def first_output(out):
    return out.logits if hasattr(out, "logits") and out.logits is not None else out.start_logits


def core_output(m, x):
    """The core model's output as the adapter's ``first_output`` (QA: the start logits)."""
    with torch.no_grad():
        args = (x["input_ids"], x["decoder_input_ids"]) if "decoder_input_ids" in x else (x["input_ids"],)
        logits = m(*args).logits
    return logits[..., 0] if m.cfg.head == "qa" else logits


@pytest.mark.parametrize("preset, kw, auto", CASES, ids=[f"{c[0]}-{c[1].get('head', 'default')}" for c in CASES])
def test_round_trip_and_auto_loading(preset, kw, auto, tmp_path):
    m = core(preset, **kw)
    x = inputs(m.cfg.arch)
    want = core_output(m, x)  # before wrapping: wrapping must not change the model
    hf = to_hf(m, decoder_start_token_id=1)
    assert from_hf(hf) is m  # wraps, never copies
    got = first_output(hf(**x))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = auto.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(hf)
    saved = hf.state_dict()
    for name, tensor in loaded.state_dict().items():  # nothing silently re-initialised
        assert torch.equal(tensor, saved[name]), name
    torch.testing.assert_close(first_output(loaded(**x)), got, rtol=0, atol=0)
    out_emb = loaded.get_output_embeddings()
    if out_emb is not None and m.cfg.tie_embeddings:
        assert out_emb.weight is loaded.get_input_embeddings().weight  # tied after loading


@pytest.mark.parametrize("kind, heads", [("mhe-mul", 1), ("mhe-add", 1), ("mqa", 1), ("mha", 4), ("gqa", 2)])
def test_generation_cache_has_the_kinds_kv_heads(kind, heads):
    m = core("tiny-decoder", kind, attn_options={"n_kv_heads": 2} if kind == "gqa" else {})
    ids = torch.randint(7, 99, (2, 4))
    ours = m.generate(ids, 7)  # before wrapping; keeps emitting tokens after EOS (6), transformers pads them with 0
    hf = to_hf(m, bos_token_id=5, eos_token_id=6).eval()
    out = hf(ids, use_cache=True)
    cache = getattr(out, mhe.hf.modeling.CACHE_FIELD)
    assert cache.layers[0].keys.shape[1] == heads and cache.get_seq_length() == 4
    for beams in (1, 3):
        a = hf.generate(ids, max_new_tokens=7, do_sample=False, num_beams=beams, use_cache=True, pad_token_id=0)
        b = hf.generate(ids, max_new_tokens=7, do_sample=False, num_beams=beams, use_cache=False, pad_token_id=0)
        assert torch.equal(a, b), beams
    after_eos = torch.cumsum(ours == 6, 1) - (ours == 6).long() > 0
    ours = ours.masked_fill(after_eos, 0)
    assert torch.equal(hf.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0), ours)


@pytest.mark.parametrize("least", [0, 3])
def test_min_and_max_new_tokens_as_in_transformers(least):
    """``model.generate``'s stop tokens, ``max_new_tokens`` and ``min_new_tokens`` give the tokens
    transformers' ``generate`` gives with the same end token (after a row stops, both pad)."""
    m = core("tiny-decoder", "mhe-mul")
    ids = torch.randint(7, 99, (2, 4))
    stop = int(m.generate(ids, 8)[0, 5])  # row 0's second greedy token
    hf = to_hf(m, eos_token_id=stop).eval()
    want = hf.generate(ids, max_new_tokens=8, min_new_tokens=least, do_sample=False, pad_token_id=0)
    got = m.generate(ids, 8, stop_ids=[stop], pad_id=0, min_new_tokens=least, return_dict=True)
    n = want.shape[1]
    assert torch.equal(got.tokens[:, :n], want) and bool((got.tokens[:, n:] == 0).all())
    assert got.finish_reasons() == ["stop" if stop in row[4:].tolist() else "length" for row in want]


@pytest.mark.parametrize("kind", ["mhe-mul", "mha"])
def test_seq2seq_generation_cached_equals_uncached(kind):
    m = core("tiny-encoder-decoder", kind)
    src = torch.randint(7, 99, (2, 6))
    ours = seq2seq_greedy(m, src, bos_id=1, eos_id=2, max_len=9)  # before wrapping
    hf = to_hf(m, decoder_start_token_id=1, bos_token_id=1, eos_token_id=2).eval()
    for beams in (1, 3):
        a = hf.generate(src, max_new_tokens=8, do_sample=False, num_beams=beams, use_cache=True, pad_token_id=0)
        b = hf.generate(src, max_new_tokens=8, do_sample=False, num_beams=beams, use_cache=False, pad_token_id=0)
        assert torch.equal(a, b), beams
    greedy = hf.generate(src, max_new_tokens=8, do_sample=False, pad_token_id=0)
    n = min(greedy.shape[1], ours.shape[1])
    assert torch.equal(greedy[:, :n], ours[:, :n])


def test_tokenizer_saved_as_fast_tokenizer(tmp_path):
    from mhe.data.tokenize import train_tokenizer

    tok = train_tokenizer("wordpiece", ["the cat sat on the mat", "a dog ran"] * 20, 60)
    fast = to_hf_tokenizer(tok)
    fast.save_pretrained(tmp_path)
    again = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert again("the cat")["input_ids"] == fast("the cat")["input_ids"]
    assert again.pad_token == "[PAD]" and again.mask_token == "[MASK]"


def _train(tmp_path, name, per_device, accum, data):
    torch.manual_seed(0)
    m = build_model("tiny-encoder", attention="mhe-mul", head="classification", num_labels=2, dropout=0.0,
                    attn_dropout=0.0, **SMALL)
    hf = to_hf(m)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=per_device,
                                          gradient_accumulation_steps=accum, max_steps=1, learning_rate=0.1,
                                          report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                          dataloader_drop_last=False, logging_strategy="no", optim="sgd")
    trainer = transformers.Trainer(model=hf, args=args, train_dataset=data)
    trainer.train()
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_trainer_gradient_accumulation(tmp_path):
    from conftest import require_data
    from mhe.data.benchmarks import read_examples
    from mhe.data.tokenize import train_tokenizer

    root = require_data("glue/RTE/dev.tsv.gz")
    ex = read_examples("rte", "dev", data_dir=root)[:4]
    tok = train_tokenizer("wordpiece", [e.text_a + " " + e.text_b for e in ex] * 5, 99)
    rows = []
    for e in ex:
        ids = tok.encode(e.text_a, e.text_b).ids[:16]
        ids = ids + [0] * (16 - len(ids))
        rows.append({"input_ids": torch.tensor(ids), "attention_mask": torch.tensor([int(i != 0) for i in ids]),
                     "labels": torch.tensor(e.label)})
    data = _Rows(rows)
    """One optimiser step on 4 RTE examples: batch 4, and batch 2 with 2 accumulation steps,
    must give the same model (the loss is averaged, not summed, over micro-batches)."""
    torch.manual_seed(0)
    start = to_hf(build_model("tiny-encoder", attention="mhe-mul", head="classification", num_labels=2,
                              dropout=0.0, attn_dropout=0.0, **SMALL)).state_dict()
    a = _train(tmp_path, "a", 4, 1, data)
    b = _train(tmp_path, "b", 2, 2, data)
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the step moved the weights
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind, heads", [("mhe-mul", 1), ("mha", 4), ("gqa", 2)])
def test_static_cache_keeps_the_kinds_kv_heads(kind, heads):
    """transformers' loop (what the adapter runs for requests its fast path does not serve, such as
    beam search) with ``cache_implementation="static"``: same tokens and logits as the dynamic
    cache; the static buffers hold the kind's K/V heads; left-padded prompts generate as they do
    alone. The fast path's session caches hold the same heads and give the same tokens."""
    hf = to_hf(core("tiny-decoder", kind, attn_options={"n_kv_heads": 2} if kind == "gqa" else {})).eval()
    ids = torch.randint(7, 99, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    fast = hf.generate(ids, cache_implementation="static", **kw)
    assert mhe.generation.session._DEFAULT[hf.mhe][-1].caches[0].k.shape[1] == heads
    hf.use_mhe_generate = False
    dyn = hf.generate(ids, **kw)
    sta = hf.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dyn.sequences, sta.sequences) and torch.equal(fast.sequences, sta.sequences)
    torch.testing.assert_close(torch.stack(sta.logits), torch.stack(dyn.logits), rtol=1e-5, atol=1e-5)
    cache = getattr(sta, mhe.hf.modeling.CACHE_FIELD)
    assert type(cache).__name__ == "StaticCache" and cache.layers[0].keys.shape[1] == heads
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[1:, :3]], 1)  # row 1's first 3 tokens, left-padded
    batch = hf.generate(torch.cat([ids[:1], padded]), attention_mask=(torch.cat([ids[:1], padded]) != 0).long(),
                        cache_implementation="static", **kw)
    alone = hf.generate(ids[1:, :3], **kw)
    torch.testing.assert_close(torch.stack(batch.logits)[:, 1], torch.stack(alone.logits)[:, 0], rtol=1e-5, atol=1e-5)


def test_attn_implementation_picks_the_kernel():
    hf = to_hf(core("tiny-decoder", "mhe-mul")).eval()
    ids = torch.randint(7, 99, (2, 5))
    sdpa = hf(ids).logits
    kernels = {m.cfg.kernel for m in hf.modules() if hasattr(m, "cfg") and hasattr(m.cfg, "kernel")}
    assert kernels == {"sdpa"}
    hf.config._attn_implementation = "eager"
    eager = hf(ids).logits
    kernels = {m.cfg.kernel for m in hf.modules() if hasattr(m, "cfg") and hasattr(m.cfg, "kernel")}
    assert kernels == {"eager"}
    torch.testing.assert_close(eager, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_static_cache_generation_under_torch_compile():
    hf = to_hf(core("tiny-decoder", "mhe-mul")).eval()
    ids = torch.randint(7, 99, (2, 5))
    want = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    hf.use_mhe_generate = False  # transformers' loop over the compiled forward
    hf.forward = torch.compile(hf.forward)
    got = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, cache_implementation="static")
    assert torch.equal(got, want)
