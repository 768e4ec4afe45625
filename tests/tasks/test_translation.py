"""Translation: data, tokenisation round trips, masks, cached vs uncached beam search, BLEU."""

import json
import math

import pytest
import torch

from conftest import require_data
from mhe.data.parallel_text import read_parallel, read_sgml
from mhe.data.tokenize import train_tokenizer
from mhe.errors import MheError
from mhe.metrics.bleu import corpus_bleu
from mhe.models import build_model
from mhe.generation.beam import beam_search
from mhe.tasks.translation import token_batches
from reference import beam_search_uncached, seq2seq_greedy


def test_bleu_hand_computed():
    # hyp "the cat sat on the mat" vs ref "the cat sat on a mat": clipped n-gram matches
    # 5/6, 3/5, 2/4, 1/3; equal lengths, so no brevity penalty.
    expect = 100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    got = corpus_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert got["bleu"] == pytest.approx(expect, abs=1e-9)
    assert got["signature"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    # corpus level: counts are summed before the geometric mean; the short second
    # hypothesis (1 word against 2) brings a brevity penalty exp(1 - 8/7)
    two = corpus_bleu(["the cat sat on the mat", "hello"], ["the cat sat on a mat", "hello world"])
    expect2 = 100 * math.exp(1 - 8 / 7) * (6 / 7 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25
    assert two["bleu"] == pytest.approx(expect2, abs=1e-9)
    assert corpus_bleu(["a b c d"], ["a b c d"])["bleu"] == pytest.approx(100.0)


def test_shared_bpe_round_trip_is_lossless():
    texts = ["Ein Mann fährt Fahrrad.", "Zwei Hunde spielen im Schnee.", "A man rides a bike.", "Straße, Größe"] * 10
    tok = train_tokenizer("bpe", texts, 300)
    for s in texts[:4] + ["Übermäßig «neu» – 3,5 km"]:
        assert tok.decode(tok.encode(s, add_special_tokens=False).ids) == s


def test_token_batches_respect_budget_and_cover_everything():
    torch.manual_seed(0)
    src = torch.randint(1, 40, (300,)).tolist()
    tgt = torch.randint(1, 40, (300,)).tolist()
    batches = token_batches(src, tgt, 256)
    flat = sorted(i for b in batches for i in b)
    assert flat == list(range(300))
    for b in batches:
        assert len(b) * (max(src[i] for i in b) + max(tgt[i] for i in b)) <= 256 or len(b) == 1


def tiny_seq2seq(kind):
    model = build_model("tiny-encoder-decoder", attention=kind, vocab_size=60, d_model=32, n_heads=4,
                        n_layers=2, max_len=16, attn_options={"n_kv_heads": 2} if kind == "gqa" else {})
    return model.double().eval()


@pytest.mark.parametrize("kind", ["mha", "mqa", "gqa", "mhe-add", "mhe-mul", "skv", "el-att", "sha"])
def test_beam_search_cached_equals_uncached(kind):
    torch.manual_seed(1)
    model = tiny_seq2seq(kind)
    src = torch.randint(3, 60, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.bool)
    mask[2, 5:] = False
    for beam in (1, 3):
        a = beam_search(model, src, mask, bos_id=1, eos_id=2, beam=beam, max_len=12)
        b = beam_search_uncached(model, src, mask, bos_id=1, eos_id=2, beam=beam, max_len=12)
        assert torch.equal(a, b), (kind, beam)
    greedy = seq2seq_greedy(model, src, mask, bos_id=1, eos_id=2, max_len=12)
    g1 = beam_search(model, src, mask, bos_id=1, eos_id=2, beam=1, max_len=12, alpha=0.0)
    assert torch.equal(g1[:, :greedy.shape[1]], greedy)


def test_beam_search_finds_a_better_sequence_than_greedy():
    torch.manual_seed(4)
    model = tiny_seq2seq("mhe-mul")
    src = torch.randint(3, 60, (8, 6))

    def logprob(seqs):
        out = model(src, seqs[:, :-1]).logits.log_softmax(-1)
        lp = out.gather(-1, seqs[:, 1:, None]).squeeze(-1)
        keep = torch.cumsum(seqs[:, 1:] == 2, 1) - (seqs[:, 1:] == 2).long() == 0  # up to the first EOS
        return (lp * keep).sum(1)

    g = beam_search(model, src, None, bos_id=1, eos_id=2, beam=1, max_len=10, alpha=0.0)
    b = beam_search(model, src, None, bos_id=1, eos_id=2, beam=5, max_len=10, alpha=0.0)
    assert (logprob(b) >= logprob(g) - 1e-9).all()


def test_collate_masks(tmp_path):
    root = require_data("multi30k/train.en.gz", "multi30k/val.en.gz")
    from mhe.tasks.translation import TranslationTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.distributed import Dist

    cfg = apply_overrides(default_run("mt", "tiny-encoder-decoder", "mqa", "multi30k"),
                          ["data.limit_lines=200", "data.vocab_size=300", 'data.task_options={"max_tokens": 400}'])
    cfg.data.data_dir = str(root)
    task = TranslationTask()
    task.setup(cfg, tmp_path, Dist())
    batch = task.collate([0])
    src, tgt, labels = batch["src"], batch["tgt"], batch["labels"]
    assert src.shape[0] == tgt.shape[0] == labels.shape[0] and src.numel() + tgt.numel() <= 400 + tgt.shape[0]
    assert torch.equal(batch["src_mask"], src != task.pad)
    assert (tgt[:, 0] == task.bos).all()
    for row in range(labels.shape[0]):
        n = int((labels[row] != -100).sum())
        assert labels[row, n - 1] == task.eos and torch.equal(tgt[row, 1:n], labels[row, :n - 1])
    assert (tmp_path / "tokenizer.json").exists()


def test_real_multi30k_and_newstest():
    root = require_data("multi30k/val.en.gz", "wmt14/newstest2014-deen-src.en.sgm.gz")
    src, tgt = read_parallel("multi30k", "valid", "en", "de", data_dir=root)
    assert len(src) == len(tgt) == 1014
    segs = read_sgml(root / "wmt14/newstest2014-deen-src.en.sgm.gz")
    assert len(segs) == 3003
    en, de = read_parallel("wmt14", "test", "en", "de", data_dir=root)
    assert len(en) == len(de) == 3003 and en[0] != de[0]


def test_mismatched_line_counts_name_both_files(tmp_path):
    (tmp_path / "multi30k").mkdir()
    (tmp_path / "multi30k" / "val.en").write_text("a\nb\nc\n")
    (tmp_path / "multi30k" / "val.de").write_text("x\ny\n")
    with pytest.raises(MheError, match=r"line counts differ: .*val.en has 3, .*val.de has 2"):
        read_parallel("multi30k", "valid", "en", "de", data_dir=tmp_path)


def test_empty_line_rule(tmp_path):
    (tmp_path / "multi30k").mkdir()
    (tmp_path / "multi30k" / "train.en").write_text("a\n\nc\nd\n")
    (tmp_path / "multi30k" / "train.de").write_text("x\ny\n\nw\n")
    assert read_parallel("multi30k", "train", "en", "de", data_dir=tmp_path) == (["a", "d"], ["x", "w"])
    (tmp_path / "multi30k" / "val.en").write_text("a\n\n")
    (tmp_path / "multi30k" / "val.de").write_text("x\ny\n")
    assert read_parallel("multi30k", "valid", "en", "de", data_dir=tmp_path) == (["a", ""], ["x", "y"])


def test_sgml_entities(tmp_path):
    p = tmp_path / "t.sgm"
    p.write_text('<srcset><doc docid="1">\n<seg id="1">Tom &amp; Jerry &quot;run&quot;</seg>\n'
                 '<seg id="2"> two </seg>\n</doc></srcset>\n')
    assert read_sgml(p) == ['Tom & Jerry "run"', "two"]


def test_translation_end_to_end_smoke(tmp_path):
    root = require_data("multi30k/train.en.gz", "multi30k/test_2016_flickr.de.gz")
    from mhe.cli import main

    out = tmp_path / "mt"
    assert main(["train-mt", "--preset", "tiny-encoder-decoder", "--attention", "mhe-mul", "--data-dir", str(root),
                 "--out", str(out), "--set", "train.steps=4", "--set", "train.progress=false",
                 "--set", "data.limit_lines=300", "--set", "data.vocab_size=300",
                 "--set", 'data.task_options={"test_sentences": 20, "beam": 2}']) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["metric"] == "bleu" and "signature" in res and res["beam"] == 2
    assert len((out / "test_translations.txt").read_text().splitlines()) == 20
