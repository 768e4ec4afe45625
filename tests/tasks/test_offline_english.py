"""The offline-english corpus: its sources in order, each line once, WikiText-2's valid/test
held out, and no text of a task we fine-tune and evaluate on."""

import json

import pytest

from conftest import require_data
from mhe.data.benchmarks import read_examples
from mhe.data.corpora import corpus, read_lines
from mhe.data import offline_english
from mhe.data.offline_english import SOURCES, source_counts, train_by_source
from mhe.errors import MheError

SQUAD_CTX = "The tower was finished in 1889."


def write_sources(d):
    """One tiny file per source, in its official format; repeats across and within sources."""
    files = {
        "wikitext-2/wiki.train.tokens": " = Title = \n\n wiki one \n wiki  two \n = Title = \n valid line \n",
        "wikitext-2/wiki.valid.tokens": " valid line \n",
        "wikitext-2/wiki.test.tokens": " test line \n",
        "ptb/ptb.train.txt": " ptb one \n wiki two \n",
        "multi30k/train.en": "A dog runs.\nRTE  text.\n",
        "glue/QNLI/dev.tsv": "index\tquestion\tsentence\tlabel\n0\tWho?\tHe did.\tentailment\n1\tWhy?\tHe did.\tentailment\n",
        "glue/QNLI/test.tsv": "index\tquestion\tsentence\n0\tWhen?\tThen.\n",
        "superglue/BoolQ/val.jsonl": json.dumps({"question": "is it", "passage": "It is.", "label": True}) + "\n",
        "superglue/BoolQ/test.jsonl": json.dumps({"question": "is it", "passage": "It is not."}) + "\n",
        "superglue/MultiRC/train.jsonl": json.dumps({"passage": {"text": "<b>Sent 1: </b>Para<br>one.",
                                                                 "questions": []}}) + "\n",
        "superglue/MultiRC/val.jsonl": "\n",
        "superglue/MultiRC/test.jsonl": json.dumps({"passage": {"text": "Para two.", "questions": []}}) + "\n",
        "squad/v1.1/dev-v1.1.json": json.dumps({"data": [{"title": "t", "paragraphs": [
            {"context": SQUAD_CTX, "qas": [{"id": f"q{i}", "question": "When?",
                                            "answers": [{"text": "1889", "answer_start": 26}]}]}
            for i in range(2)]}]}),
        "wmt14/newstest2014-deen-ref.en.sgm": '<refset>\n<doc docid="d">\n<seg id="1">News &amp; views</seg>\n'
                                              '</doc>\n</refset>\n',
        "glue/RTE/train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tRTE text.\tNever.\tentailment\n",
    }
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


EXPECTED = [("wikitext-2 train", "= Title ="), ("wikitext-2 train", "wiki one"), ("wikitext-2 train", "wiki two"),
            ("ptb train", "ptb one"), ("multi30k en train", "A dog runs."),
            ("qnli dev+test", "Who?"), ("qnli dev+test", "He did."), ("qnli dev+test", "Why?"),
            ("qnli dev+test", "When?"), ("qnli dev+test", "Then."),
            ("boolq val+test", "It is."), ("boolq val+test", "is it"), ("boolq val+test", "It is not."),
            ("multirc passages", "Sent 1: Para one."), ("multirc passages", "Para two."),
            ("squad v1.1 dev contexts", SQUAD_CTX), ("newstest2014 en", "News & views")]


@pytest.fixture(autouse=True)
def evaluate_rte_only(monkeypatch):
    """The tiny data folder holds one evaluated task's file: RTE train."""
    monkeypatch.setattr(offline_english, "EVALUATED", {"rte": ("train",)})


def test_sources_in_order_deduplicated_and_held_out(tmp_path):
    d = write_sources(tmp_path)
    assert list(train_by_source(d)) == EXPECTED
    assert read_lines("offline-english", "train", data_dir=d, limit=4) == [t for _, t in EXPECTED[:4]]
    assert read_lines("offline-english", "valid", data_dir=d) == ["valid line"]
    assert read_lines("offline-english", "test", data_dir=d) == ["test line"]
    counts = source_counts(d)
    assert counts["qnli dev+test"] == {"lines": 5, "words": 6} and list(counts) == list(SOURCES)
    assert not corpus("offline-english").word_level


def test_a_limit_reads_no_later_source(tmp_path):
    d = write_sources(tmp_path)
    (d / "glue/QNLI/dev.tsv").write_text("broken")  # never opened: the limit is reached before
    assert len(read_lines("offline-english", "train", data_dir=d, limit=5)) == 5
    with pytest.raises(MheError, match=r"QNLI/dev.tsv: header lacks column 'question'"):
        read_lines("offline-english", "train", data_dir=d)


def test_a_malformed_record_is_named(tmp_path):
    d = write_sources(tmp_path)
    (d / "superglue/BoolQ/test.jsonl").write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(MheError, match=r"BoolQ/test.jsonl: record 1: malformed record \(missing field 'passage'\)"):
        read_lines("offline-english", "train", data_dir=d)
    with pytest.raises(MheError, match="no hub source"):
        read_lines("offline-english", "train", data_dir=d, source="hub")


EVALUATED = ("rte", "mrpc", "cola", "sst2", "stsb", "wnli", "cb", "copa", "wic")


@pytest.mark.slow
def test_real_corpus_holds_no_evaluated_task_text(monkeypatch):
    """On the stored files: every source contributes, and no line is the text of an example of
    a task we fine-tune and evaluate on (train or dev, either side)."""
    root = require_data("wikitext-2/wiki.train.tokens.xz", "ptb/ptb.train.txt.gz", "multi30k/train.en.gz",
                        "glue/QNLI/test.tsv.gz", "superglue/BoolQ/test.jsonl.gz", "superglue/MultiRC/test.jsonl.gz",
                        "squad/v1.1/dev-v1.1.json.xz", "wmt14/newstest2014-deen-ref.en.sgm.gz", "glue/RTE/dev.tsv.gz")
    monkeypatch.undo()  # every evaluated task
    lines = {t: s for s, t in train_by_source(root)}
    assert "A man is using a large pole to remove letters from a sign." not in lines  # STS-B, also in Multi30k
    assert set(lines.values()) == set(SOURCES) and len(lines) > 100_000
    evaluated = {" ".join(t.split()) for task in EVALUATED for split in ("train", "dev")
                 for ex in read_examples(task, split, data_dir=root) for t in (ex.text_a, ex.text_b) if t}
    assert len(evaluated) > 10_000
    assert not [t for t in evaluated if t in lines]
