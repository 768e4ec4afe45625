"""No figure from text a tokenizer cannot see (issue 58): a tokenizer of ids only (``mhe convert``
of a Hugging Face folder without one) is known as such and refused wherever text is encoded, and a
corpus that a tokenizer maps mostly to ``[PAD]``/unknown ids, or to a handful of ids, is refused on
its first encoding, read back from the token cache included; progress off a terminal comes as whole
lines (no carriage returns in a log)."""

import sys

import pytest
import torch

from mhe.convert.sources import ids_only_tokenizer
from mhe.data.tokenize import check_encoded, describe_tokenizer, ids_only, train_tokenizer
from mhe.errors import MheError
from mhe.tasks import text

LINES = [f"the cat {i} sat on the mat and the dog {i % 7} ran home" for i in range(120)]
OTHER = [f"stock prices {i} rose sharply as traders bought shares" for i in range(120)]


def _ids_only(tmp_path, vocab=64):
    (tmp_path / "config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return ids_only_tokenizer(tmp_path, vocab)[0]


def test_an_ids_only_tokenizer_is_known_and_never_encodes_a_corpus(tmp_path):
    tok = _ids_only(tmp_path)
    assert ids_only(tok) and describe_tokenizer(tok) == "ids only, 64 entries"
    for kind, name in (("bpe", "BPE"), ("word", "word-level"), ("wordpiece", "WordPiece")):
        real = train_tokenizer(kind, LINES, 300)
        assert not ids_only(real) and describe_tokenizer(real) == f"{name}, {real.get_vocab_size():,} entries"
    with pytest.raises(MheError, match=r"holds ids only .* --tokenizer FOLDER") as e:
        text.token_stream(tok, LINES)
    assert "\n" not in str(e.value)


def test_a_corpus_the_tokenizer_does_not_cover_is_refused():
    """A word-level tokenizer of other text maps the corpus to [UNK]; a real one passes."""
    other = train_tokenizer("word", OTHER, 300)
    with pytest.raises(MheError, match=r"tokenizing: 120 lines: the tokenizer maps it to \d+ distinct id\(s\), "
                                       r"\d+% of 1,560 tokens \[PAD\] or unknown"):
        text.token_stream(other, LINES)
    stream = text.token_stream(train_tokenizer("word", LINES, 300), LINES)
    assert stream.numel() == 120 * 14


def test_a_handful_of_distinct_ids_is_refused_and_a_short_text_is_not():
    tok = train_tokenizer("word", LINES, 300)
    eos, the, cat = tok.token_to_id("[EOS]"), tok.token_to_id("the"), tok.token_to_id("cat")
    with pytest.raises(MheError, match="maps it to 2 distinct id"):
        check_encoded(tok, torch.tensor([the, cat, eos] * 60), eos, "valid")
    check_encoded(tok, torch.tensor([the, cat, eos] * 20), eos, "valid")  # 40 tokens: too few to judge
    pad = tok.token_to_id("[PAD]")
    with pytest.raises(MheError, match="51% of 100 tokens"):
        check_encoded(tok, [pad] * 51 + list(range(10, 59)), eos, "valid")
    check_encoded(tok, [pad] * 50 + list(range(10, 60)), eos, "valid")  # half: still allowed


def test_a_stream_read_back_from_the_cache_is_checked_too(tmp_path, monkeypatch):
    monkeypatch.setenv("MHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(text, "CACHED_FROM_LINES", 50)
    tok = train_tokenizer("word", LINES, 300)
    stream = text.token_stream(tok, LINES)
    (entry,) = (tmp_path / "tokens").iterdir()
    torch.zeros_like(stream).to(torch.int32).numpy().tofile(entry)  # a cache entry of [PAD]s only
    with pytest.raises(MheError, match="100% of"):
        text.token_stream(tok, LINES)


def test_progress_off_a_terminal_is_whole_lines(capsys, monkeypatch):
    from mhe.progress import bar, each

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with bar(3, desc="phase", unit="window", enabled=True) as shown:
        shown.update(2)
        shown.update(1)
    assert list(each(range(4), total=4, desc="decoding", unit="sentence", enabled=True)) == [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert "\r" not in err and err.count("\n") == 2
    assert err.startswith("phase: 3/3 windows in ") and "decoding: 4/4 sentences in " in err


def test_transformers_bars_are_off_off_a_terminal(monkeypatch):
    logging = pytest.importorskip("transformers.utils.logging")
    from mhe.progress import quiet_library_bars

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    was = logging.is_progress_bar_enabled()
    try:
        logging.enable_progress_bar()
        quiet_library_bars()
        assert not logging.is_progress_bar_enabled()
    finally:
        (logging.enable_progress_bar if was else logging.disable_progress_bar)()


def test_the_cards_perplexities_name_their_unit_and_an_ids_only_tokenizer_is_said():
    from mhe.tasks.model_card import _tokenizer_lines, _with_unit

    assert _with_unit("perplexity", {"perplexity_per": "word"}) == "perplexity (per word)"
    assert _with_unit("word_perplexity_stride256", {"perplexity_per": "token"}) == \
        "word_perplexity_stride256 (per word)"
    assert _with_unit("tokens", {"perplexity_per": "token"}) == "tokens"
    assert "holds ids only" in " ".join(_tokenizer_lines("ids only, 64 entries", {}))
    assert "holds ids only" not in " ".join(_tokenizer_lines("BPE, 300 entries", {"perplexity": 3.0}))
