"""Data readers (real benchmark files via MHE_DATA) and tokenizer round trips."""

import gzip
import lzma

import pytest

from conftest import require_data
from mhe.data.corpora import read_lines, word_count
from mhe.data.paths import find_file, open_text
from mhe.data.tokenize import SPECIALS, load_tokenizer, save_tokenizer, train_tokenizer
from mhe.errors import MheError


def test_plain_gzip_and_xz_read_the_same(tmp_path):
    text = "the cat\nsat on the mat\n\nend\n"
    (tmp_path / "a.txt").write_text(text)
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write(text)
    with lzma.open(tmp_path / "c.txt.xz", "wt") as f:
        f.write(text)
    got = [open_text(find_file(name, tmp_path)).read() for name in ("a.txt", "b.txt", "c.txt")]
    assert got == [text] * 3


def test_missing_file_names_path_and_setting(tmp_path):
    with pytest.raises(MheError, match=r"data file not found: .*ptb/ptb.train.txt .*MHE_DATA"):
        read_lines("ptb", "train", data_dir=tmp_path)
    with pytest.raises(MheError, match="unknown dataset 'ptb2'; valid: ptb, wikitext-2, wikitext-103"):
        read_lines("ptb2", "train")
    with pytest.raises(MheError, match="unknown split 'dev'"):
        read_lines("ptb", "dev")


def test_offline_hub_path_says_what_is_missing():
    try:
        import datasets  # noqa: F401
        pytest.skip("datasets is installed")
    except ImportError:
        pass
    with pytest.raises(MheError, match="needs the optional 'datasets' package .*put ptb/ptb.train.txt under --data-dir"):
        read_lines("ptb", "train", source="hub")


def test_real_ptb_and_wikitext_counts():
    root = require_data("ptb/ptb.test.txt.gz", "wikitext-2/wiki.valid.tokens.gz")
    ptb = read_lines("ptb", "test", data_dir=root)
    assert len(ptb) == 3761 and word_count(ptb) == 78669 + 3761  # MANIFEST: 3,761 lines, 78,669 tokens
    wiki = read_lines("wikitext-2", "valid", data_dir=root)
    assert wiki[0].startswith("= Homarus gammarus =")


def test_malformed_line_is_named(tmp_path):
    (tmp_path / "ptb").mkdir()
    (tmp_path / "ptb" / "ptb.valid.txt").write_text("fine line\nbad \x00 line\n")
    with pytest.raises(MheError, match=r"ptb.valid.txt:2: malformed line"):
        read_lines("ptb", "valid", data_dir=tmp_path)


TEXTS = ["The quick brown fox jumps over the lazy dog.", "Ünïcödé — and   spaces!", "numbers 12345 and 3.14"] * 20


def test_byte_level_bpe_is_lossless(tmp_path):
    tok = train_tokenizer("bpe", TEXTS, 300)
    for s in TEXTS[:3] + ["never seen: ∑ 𝛼 ☃"]:
        assert tok.decode(tok.encode(s).ids) == s
    save_tokenizer(tok, tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXTS[0]).ids == tok.encode(TEXTS[0]).ids
    assert [again.token_to_id(s) for s in SPECIALS] == list(range(len(SPECIALS)))


def test_wordpiece_and_word_level():
    wp = train_tokenizer("wordpiece", TEXTS, 200)
    enc = wp.encode("the quick brown fox")
    assert wp.decode(enc.ids) == "the quick brown fox"
    word = train_tokenizer("word", ["a b c", "a b", "a"], 100)
    assert word.get_vocab_size() == len(SPECIALS) + 3
    assert word.encode("a c zzz").tokens == ["a", "c", "[UNK]"]


def test_tokenizer_errors():
    with pytest.raises(MheError, match="unknown tokenizer 'sentencepiece'"):
        train_tokenizer("sentencepiece", TEXTS, 100)
    with pytest.raises(MheError, match="vocab_size must be at least 8"):
        train_tokenizer("bpe", TEXTS, 5)
