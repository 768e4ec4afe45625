"""Malformed input, table-driven: every case must end in one line naming the bad value.

Four tables: command-line arguments and output paths (run in-process through
``mhe.cli.main``; exit code 2, exactly one line on stderr, no traceback, nothing
left in the output folder), data files (broken files written into ``tmp_path``;
:class:`MheError` naming the file and line or byte), and Python API calls (the
exception type and the argument named). A few representative cases run as real
``python -m mhe`` subprocesses.
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhe.cli import main
from mhe.errors import MheError

B, T, M, N, V = 2, 7, 32, 4, 99

# ------------------------------------------------------------------ command line
# (id, argv with {tmp} for the test folder, text the one error line must contain)
CLI_CASES = [
    # mhe params / memory / scaling
    ("params-kinds-empty", ["params", "--preset", "bert-base", "--kinds", ""], "--kinds '' names no attention kind"),
    ("params-kinds-commas", ["params", "--preset", "bert-base", "--kinds", ",,"], "--kinds ',,' names no"),
    ("params-kinds-unknown", ["params", "--preset", "bert-base", "--kinds", "mha,xyz"], "unknown attention kind 'xyz'"),
    ("params-layers-neg", ["params", "--preset", "bert-base", "--layers", "-2"], "got -2 (--layers)"),
    ("params-heads-zero", ["params", "--preset", "bert-base", "--heads", "0"], "got 0 (--heads)"),
    ("params-head-dim-neg", ["params", "--preset", "bert-base", "--head-dim", "-1"], "got -1 (--head-dim)"),
    ("params-d-model-zero", ["params", "--preset", "bert-base", "--d-model", "0"], "got 0 (--d-model)"),
    ("params-custom-layers-zero", ["params", "--layers", "0", "--heads", "4", "--head-dim", "8"], "got 0 (--layers)"),
    ("params-layers-not-int", ["params", "--layers", "two", "--heads", "4", "--head-dim", "8"], "'two'"),
    ("params-preset-unknown", ["params", "--preset", "nope"], "unknown preset 'nope'"),
    ("params-arch-unknown", ["params", "--preset", "bert-base", "--arch", "rnn"], "'rnn'"),
    ("params-missing-sizes", ["params", "--layers", "2"], "missing --heads, --head-dim"),
    ("params-unknown-flag", ["params", "--preset", "bert-base", "--frobnicate"], "--frobnicate"),
    ("memory-batch-zero", ["memory", "--preset", "bert-base", "--batch", "0"], "batch must be a positive integer, got 0"),
    ("memory-seq-len-neg", ["memory", "--preset", "bert-base", "--seq-len", "-3"], "got -3"),
    ("memory-batch-float", ["memory", "--preset", "bert-base", "--batch", "2.5"], "'2.5'"),
    ("scaling-head-dim-zero", ["scaling", "--head-dim", "0"], "--head-dim must be a positive integer, got 0"),
    ("unknown-command", ["frobnicate"], "'frobnicate'"),
    # mhe bench
    ("bench-reps-neg", ["bench", "--reps", "-1"], "--reps must be a positive integer, got -1"),
    ("bench-reps-zero", ["bench", "--reps", "0"], "--reps must be a positive integer, got 0"),
    ("bench-train-batch-zero", ["bench", "--train-batch", "0"], "--train-batch must be a positive integer, got 0"),
    ("bench-kind-unknown", ["bench", "--kinds", "mha,fnet"], "unknown bench kind 'fnet'"),
    ("bench-section-unknown", ["bench", "--sections", "attn,nap"], "unknown bench section 'nap'"),
    ("bench-decode-kernel", ["bench", "--kernel", "cublas", "--sections", "attn"], "'cublas'"),
    # mhe translate / eval
    ("translate-beam-neg", ["translate", "--checkpoint", "{tmp}/dir", "--beam", "-2"], "--beam must be a positive integer"),
    ("translate-beam-zero", ["translate", "--checkpoint", "{tmp}/dir", "--beam", "0"], "got 0"),
    ("translate-beam-float", ["translate", "--checkpoint", "{tmp}/dir", "--beam", "1.5"], "'1.5'"),
    ("translate-alpha-nan", ["translate", "--checkpoint", "{tmp}/dir", "--alpha", "nan"], "--alpha must be a finite"),
    ("translate-alpha-inf", ["translate", "--checkpoint", "{tmp}/dir", "--alpha", "inf"], "got inf"),
    ("translate-dtype", ["translate", "--checkpoint", "{tmp}/dir", "--dtype", "float16"], "--dtype must be one of float32, bfloat16"),
    ("translate-alpha-neg", ["translate", "--checkpoint", "{tmp}/dir", "--alpha", "-0.5"], "got -0.5"),
    ("translate-input-missing", ["translate", "--checkpoint", "{tmp}/dir", "--input", "{tmp}/none.txt"],
     "--input {tmp}/none.txt does not exist"),
    ("translate-input-not-utf8", ["translate", "--checkpoint", "{tmp}/dir", "--input", "{tmp}/latin1.txt"],
     "latin1.txt: line 2: byte 8 (0xf6) is not UTF-8"),
    ("translate-input-corrupt-gz", ["translate", "--checkpoint", "{tmp}/dir", "--input", "{tmp}/junk.gz"],
     "junk.gz: corrupt compressed file"),
    ("eval-stride-zero", ["eval", "--checkpoint", "{tmp}/dir", "--stride", "0"], "--stride=0 is out of range; --stride must be > 0"),
    ("eval-stride-neg", ["eval", "--checkpoint", "{tmp}/dir", "--stride", "-5"], "--stride=-5"),
    ("eval-split-unknown", ["eval", "--checkpoint", "{tmp}/dir", "--split", "train"], "'train'"),
    # training commands
    ("train-attention-unknown", ["train", "--task", "lm", "--preset", "tiny-decoder", "--attention", "zz"],
     "model.attention='zz' is not allowed"),
    ("train-preset-unknown", ["train", "--task", "lm", "--preset", "nope"], "unknown preset 'nope'"),
    ("train-missing-preset", ["train", "--task", "lm"], "--preset"),
    ("pretrain-enc-dec", ["pretrain", "--preset", "tiny-encoder-decoder", "--data", "ptb"], "'tiny-encoder-decoder'"),
    ("pretrain-no-data", ["pretrain", "--preset", "tiny-decoder"], "pretrain needs --data"),
    ("finetune-seeds-zero", ["finetune", "--task", "rte", "--checkpoint", "{tmp}/dir", "--seeds", "0", "--out",
                             "{tmp}/ft"], "--seeds must be positive, got 0"),
    ("finetune-task-unknown", ["finetune", "--task", "nope", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/ft"],
     "unknown fine-tuning task 'nope'"),
    ("finetune-not-a-run", ["finetune", "--task", "rte", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/ft"],
     "--run {tmp}/dir is not a run folder: pass the folder that holds config.json"),
    ("finetune-missing-run", ["finetune", "--task", "rte", "--run", "{tmp}/none", "--out", "{tmp}/ft"],
     "--run {tmp}/none does not exist"),
    ("finetune-diagnostic", ["finetune", "--task", "ax-b", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/ft"],
     "ax-b is a diagnostic with a test split only: fine-tune on rte, then score it with mhe diagnostics"),
    # mhe compare / report
    ("compare-workers-zero", ["compare", "--preset", "cpu-recall", "--workers", "0", "--out", "{tmp}/c"],
     "--workers must be a positive integer, got 0"),
    ("compare-seeds-zero", ["compare", "--preset", "cpu-recall", "--seeds", "0", "--out", "{tmp}/c"], "got 0"),
    ("compare-kind-unknown", ["compare", "--preset", "cpu-recall", "--kinds", "mha,zz", "--out", "{tmp}/c"], "'zz'"),
    ("compare-preset-unknown", ["compare", "--preset", "nope", "--out", "{tmp}/c"], "unknown preset 'nope'"),
    ("compare-paper-unknown", ["compare", "--preset", "cpu-recall", "--paper", "table9", "--out", "{tmp}/c"],
     "unknown paper table 'table9'"),
    ("report-paper-other-metric", ["report", "{tmp}/cmp", "--paper", "table2-ptb"], "'table2-ptb' reports perplexity"),
    ("report-paper-other-task", ["report", "{tmp}/cmp", "--paper", "table1-rte"], "'table1-rte' is task 'rte'"),
    ("report-paper-bleu", ["report", "{tmp}/cmp", "--paper", "table3-wmt14"], "'table3-wmt14' reports bleu"),
    ("report-paper-unknown", ["report", "{tmp}/cmp", "--paper", "table9"], "unknown paper table 'table9'"),
    ("report-no-runs", ["report", "{tmp}/dir"], "no finished runs"),
]

# output paths: checked before any work; the error names the option and the path
OUT_CASES = [
    ("train-out-file", ["train", "--task", "recall", "--preset", "tiny-decoder", "--out", "{tmp}/file.txt"],
     "--out {tmp}/file.txt is an existing file"),
    ("train-out-under-file", ["train", "--task", "recall", "--preset", "tiny-decoder", "--out", "{tmp}/file.txt/run"],
     "{tmp}/file.txt is a file, not a folder"),
    ("pretrain-out-file", ["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--out", "{tmp}/file.txt"],
     "is an existing file"),
    ("pretrain-out-deep-under-file", ["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--out",
                                      "{tmp}/file.txt/a/b"], "{tmp}/file.txt is a file"),
    ("train-mt-out-file", ["train-mt", "--preset", "tiny-encoder-decoder", "--out", "{tmp}/file.txt"],
     "is an existing file"),
    ("finetune-out-file", ["finetune", "--task", "rte", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/file.txt"],
     "--out {tmp}/file.txt is an existing file"),
    ("compare-out-file", ["compare", "--preset", "cpu-recall", "--out", "{tmp}/file.txt"], "is an existing file"),
    ("compare-out-under-file", ["compare", "--preset", "cpu-recall", "--out", "{tmp}/file.txt/c"], "is a file"),
    ("eval-out-folder", ["eval", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/dir"], "--out {tmp}/dir is a folder"),
    ("eval-out-missing-folder", ["eval", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/missing/r.json"],
     "folder {tmp}/missing does not exist"),
    ("overview-out-missing-folder", ["overview", "{tmp}/cmp", "--out", "{tmp}/missing/o.md"], "does not exist"),
    ("eval-out-under-file", ["eval", "--checkpoint", "{tmp}/dir", "--out", "{tmp}/file.txt/r.json"], "is a file"),
    ("scaling-plot-missing-folder", ["scaling", "--plot", "{tmp}/missing/s.png"], "folder {tmp}/missing does not exist"),
    ("scaling-plot-extension", ["scaling", "--plot", "{tmp}/s.xyz"], "unknown file type '.xyz'"),
    ("scaling-plot-no-extension", ["scaling", "--plot", "{tmp}/plot"], "unknown file type '(none)'"),
    ("scaling-plot-folder", ["scaling", "--plot", "{tmp}/dir"], "--plot {tmp}/dir is a folder"),
    ("scaling-plot-under-file", ["scaling", "--plot", "{tmp}/file.txt/s.png"], "is a file, not a folder"),
    ("bench-json-folder", ["bench", "--json", "{tmp}/dir"], "--json {tmp}/dir is a folder"),
    ("bench-json-under-file", ["bench", "--json", "{tmp}/file.txt/b.json"], "{tmp}/file.txt is a file"),
    ("overview-out-folder", ["overview", "{tmp}/cmp", "--out", "{tmp}/dir"], "--out {tmp}/dir is a folder"),
    ("overview-plot-extension", ["overview", "{tmp}/cmp", "--plot", "{tmp}/p.docx"], "unknown file type '.docx'"),
    ("overview-plot-missing-folder", ["overview", "{tmp}/cmp", "--plot", "{tmp}/nope/p.png"], "does not exist"),
]


def _result(kind: str, score: float, params: int) -> dict:
    return {"task": "recall", "metric": "accuracy", "higher_is_better": True, "attention": kind, "seed": 0,
            "score": score, "attention_params": params}


@pytest.fixture
def cli_folder(tmp_path, monkeypatch):
    """A working folder with an existing file, an empty folder, a finished comparison and
    two bad input files; the current directory, so default outputs would land here too."""
    (tmp_path / "file.txt").write_text("x\n")
    (tmp_path / "dir").mkdir()
    for kind, score, params in (("sha", 0.5, 100), ("mha", 0.6, 400)):
        run = tmp_path / "cmp" / "runs" / f"{kind}-seed0"
        run.mkdir(parents=True)
        (run / "results.json").write_text(json.dumps(_result(kind, score, params)))
    (tmp_path / "latin1.txt").write_bytes("fine\nschön\n".encode("latin-1"))
    (tmp_path / "junk.gz").write_bytes(b"this is not gzip data\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


def _run_cli(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse
        return e.code


@pytest.mark.parametrize("argv, named", [pytest.param(a, n, id=i) for i, a, n in CLI_CASES + OUT_CASES])
def test_cli_bad_input(argv, named, cli_folder, capsys):
    tmp = cli_folder
    argv = [a.format(tmp=tmp) for a in argv]
    before = _tree(tmp)
    code = _run_cli(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert "Traceback" not in captured.err
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("mhe"), lines[0]
    assert named.format(tmp=tmp) in lines[0]
    assert _tree(tmp) == before  # no file or folder left behind


def test_cli_table_size():
    assert len(CLI_CASES) + len(OUT_CASES) >= 70


# ------------------------------------------------------------------ data files
def _gz(data: bytes) -> bytes:
    return gzip.compress(data)


def _xz(data: bytes) -> bytes:
    return lzma.compress(data)


TEXT = b"".join(b"line %d of the corpus with some words\n" % i for i in range(200))
GOOD_LINES = b"a b c\n"


def _ptb(root: Path, train: bytes, name: str = "ptb.train.txt", test: bytes = GOOD_LINES) -> None:
    (root / "ptb").mkdir(parents=True, exist_ok=True)
    (root / "ptb" / name).write_bytes(train)
    (root / "ptb" / "ptb.test.txt").write_bytes(test)


def _read_ptb(root: Path, split: str = "train"):
    from mhe.data.corpora import read_lines

    return read_lines("ptb", split, data_dir=root)


def _m30k(root: Path, files: dict[str, bytes]) -> None:
    (root / "multi30k").mkdir(parents=True, exist_ok=True)
    for name, data in {"train.en": b"a\nb\n", "train.de": b"x\ny\n", "val.en": b"a\n", "val.de": b"x\n",
                       **files}.items():
        (root / "multi30k" / name).write_bytes(data)


def _read_m30k(root: Path, split: str = "train"):
    from mhe.data.parallel_text import read_parallel

    return read_parallel("multi30k", split, "en", "de", data_dir=root)


def _read_wmt_test(root: Path):
    from mhe.data.parallel_text import read_parallel

    return read_parallel("wmt14", "test", "en", "de", data_dir=root)


def _sg(root: Path, task_dir: str, lines: bytes) -> None:
    (root / "superglue" / task_dir).mkdir(parents=True, exist_ok=True)
    (root / "superglue" / task_dir / "train.jsonl").write_bytes(lines)


def _glue(root: Path, task_dir: str, text: bytes, name: str = "train.tsv") -> None:
    (root / "glue" / task_dir).mkdir(parents=True, exist_ok=True)
    (root / "glue" / task_dir / name).write_bytes(text)


def _squad(root: Path, data: bytes) -> None:
    (root / "squad" / "v1.1").mkdir(parents=True, exist_ok=True)
    (root / "squad" / "v1.1" / "train-v1.1.json").write_bytes(data)


def _examples(task: str):
    from mhe.data.benchmarks import read_examples

    return lambda root: read_examples(task, "train", data_dir=root)


BOOLQ = {"question": "q", "passage": "p", "label": True, "idx": 0}
WIC = {"word": "w", "sentence1": "a w b", "sentence2": "w c", "start1": 2, "end1": 3, "start2": 0, "end2": 1,
       "label": False, "idx": 0}
SQUAD_QA = {"id": "q1", "question": "who?", "answers": [{"text": "Ann", "answer_start": 0}]}


def _jl(*records) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records)


def _squad_doc(data) -> bytes:
    return json.dumps({"version": "1.1", "data": data}).encode()


# (id, write(root), read(root), texts the one error line must contain ({root} is the data folder))
DATA_CASES = [
    # text corpora: compression, encoding, empty splits, malformed lines
    ("ptb-gz-corrupt", lambda r: _ptb(r, b"plain text, not gzip\n", "ptb.train.txt.gz"), _read_ptb,
     ["ptb.train.txt.gz", "corrupt compressed file"]),
    ("ptb-gz-truncated", lambda r: _ptb(r, _gz(TEXT)[:200], "ptb.train.txt.gz"), _read_ptb,
     ["ptb.train.txt.gz", "truncated compressed file"]),
    ("ptb-gz-bad-crc", lambda r: _ptb(r, _gz(TEXT)[:-8] + b"\0" * 8, "ptb.train.txt.gz"), _read_ptb,
     ["ptb.train.txt.gz", "corrupt compressed file"]),
    ("ptb-xz-corrupt", lambda r: _ptb(r, b"\xfd7zXZ\x00" + b"garbage" * 10, "ptb.train.txt.xz"), _read_ptb,
     ["ptb.train.txt.xz", "corrupt compressed file"]),
    ("ptb-xz-truncated", lambda r: _ptb(r, _xz(TEXT)[:100], "ptb.train.txt.xz"), _read_ptb,
     ["ptb.train.txt.xz", "truncated compressed file"]),
    ("ptb-not-utf8", lambda r: _ptb(r, b"good line\nbad \xff here\n"), _read_ptb,
     ["ptb.train.txt: line 2: byte 14 (0xff) is not UTF-8"]),
    ("ptb-not-utf8-first-byte", lambda r: _ptb(r, b"\xc3\x28 x\n"), _read_ptb, ["line 1: byte 0 (0xc3)"]),
    ("ptb-not-utf8-in-gz", lambda r: _ptb(r, _gz(b"ok\nok\n\x80bad\n"), "ptb.train.txt.gz"), _read_ptb,
     ["ptb.train.txt.gz: line 3: byte 6 (0x80)"]),
    ("ptb-not-utf8-in-xz", lambda r: _ptb(r, _xz(b"ok\n\xfe\n"), "ptb.train.txt.xz"), _read_ptb,
     ["line 2: byte 3 (0xfe)"]),
    ("ptb-utf16", lambda r: _ptb(r, "hello\n".encode("utf-16")), _read_ptb, ["line 1: byte 0 (0xff)"]),
    ("ptb-test-blank-lines", lambda r: _ptb(r, GOOD_LINES, test=b"\n  \n\t\n\n"), lambda r: _read_ptb(r, "test"),
     ["ptb.test.txt", "the test split has no text"]),
    ("ptb-train-empty", lambda r: _ptb(r, b""), _read_ptb, ["ptb.train.txt", "no text"]),
    ("ptb-gz-empty-text", lambda r: _ptb(r, _gz(b"\n\n"), "ptb.train.txt.gz"), _read_ptb, ["no text"]),
    ("ptb-nul-byte", lambda r: _ptb(r, b"a\nb\x00c\n"), _read_ptb, ["ptb.train.txt:2: malformed line (NUL byte)"]),
    ("ptb-missing", lambda r: (r / "ptb").mkdir(), _read_ptb, ["data file not found", "ptb.train.txt"]),
    # parallel text
    ("m30k-not-utf8", lambda r: _m30k(r, {"train.de": b"x\n\xe4y\n"}), _read_m30k,
     ["train.de: line 2: byte 2 (0xe4)"]),
    ("m30k-valid-empty", lambda r: _m30k(r, {"val.en": b"", "val.de": b""}), lambda r: _read_m30k(r, "valid"),
     ["val.en: no text"]),
    ("m30k-valid-blank", lambda r: _m30k(r, {"val.de": b"\n \n"}), lambda r: _read_m30k(r, "valid"),
     ["val.de: no text"]),
    ("m30k-counts-differ", lambda r: _m30k(r, {"train.de": b"x\ny\nz\n"}), _read_m30k,
     ["line counts differ", "train.en has 2", "train.de has 3"]),
    ("m30k-no-full-pair", lambda r: _m30k(r, {"train.en": b"a\n\n", "train.de": b"\ny\n"}), _read_m30k,
     ["multi30k train: no pair has text on both sides"]),
    ("wmt-sgml-no-seg", lambda r: ((r / "wmt14").mkdir(),
                                   (r / "wmt14" / "newstest2014-deen-src.en.sgm").write_text("<doc></doc>\n"),
                                   (r / "wmt14" / "newstest2014-deen-ref.de.sgm").write_text("<doc></doc>\n")),
     _read_wmt_test,
     ["newstest2014-deen-src.en.sgm: no <seg> with text"]),
    ("wmt-sgml-not-utf8", lambda r: ((r / "wmt14").mkdir(),
                                     (r / "wmt14" / "newstest2014-deen-src.en.sgm").write_bytes(b"<seg>\xff</seg>\n"),
                                     (r / "wmt14" / "newstest2014-deen-ref.de.sgm").write_text("<seg>x</seg>\n")),
     _read_wmt_test,
     ["src.en.sgm: line 1: byte 5 (0xff)"]),
    # SuperGLUE JSONL records
    ("boolq-array-record", lambda r: _sg(r, "BoolQ", _jl(BOOLQ, [1, 2])), _examples("boolq"),
     ["BoolQ/train.jsonl: record 2: expected a JSON object, got a JSON list"]),
    ("boolq-string-record", lambda r: _sg(r, "BoolQ", _jl("text")), _examples("boolq"), ["record 1", "got a JSON str"]),
    ("boolq-number-record", lambda r: _sg(r, "BoolQ", _jl(BOOLQ, BOOLQ, 7)), _examples("boolq"),
     ["record 3", "JSON int"]),
    ("boolq-not-json", lambda r: _sg(r, "BoolQ", _jl(BOOLQ, b"{question: q")), _examples("boolq"),
     ["train.jsonl: record 2: not valid JSON"]),
    ("boolq-truncated-line", lambda r: _sg(r, "BoolQ", _jl(json.dumps(BOOLQ)[:20].encode())), _examples("boolq"),
     ["record 1: not valid JSON"]),
    ("boolq-missing-field", lambda r: _sg(r, "BoolQ", _jl({"question": "q", "label": True})), _examples("boolq"),
     ["record 1: missing field 'passage'"]),
    ("boolq-bad-label", lambda r: _sg(r, "BoolQ", _jl({**BOOLQ, "label": "maybe"})), _examples("boolq"),
     ["record 1: label 'maybe' is not one of False, True"]),
    ("boolq-not-utf8", lambda r: _sg(r, "BoolQ", _jl(BOOLQ) + b'{"question": "\xe9"}\n'), _examples("boolq"),
     ["train.jsonl: line 2: byte"]),
    ("boolq-gz-corrupt", lambda r: (_sg(r, "BoolQ", b""), (r / "superglue/BoolQ/train.jsonl").unlink(),
                                    (r / "superglue/BoolQ/train.jsonl.gz").write_bytes(b"\x1f\x8b\x08junk")),
     _examples("boolq"), ["train.jsonl.gz", "compressed file"]),
    ("boolq-empty", lambda r: _sg(r, "BoolQ", b"\n\n"), _examples("boolq"), ["the train split of boolq has no examples"]),
    ("wic-offset-string", lambda r: _sg(r, "WiC", _jl({**WIC, "start1": "2"})), _examples("wic"),
     ["WiC/train.jsonl: record 1: malformed record"]),
    ("wic-missing-end", lambda r: _sg(r, "WiC", _jl({k: v for k, v in WIC.items() if k != "end2"})), _examples("wic"),
     ["record 1: missing field 'end2'"]),
    ("wsc-target-not-object", lambda r: _sg(r, "WSC", _jl({"text": "a b", "target": [1], "label": True})),
     _examples("wsc"), ["WSC/train.jsonl: record 1: malformed record"]),
    ("wsc-span-outside", lambda r: _sg(r, "WSC", _jl({"text": "a b", "label": True, "target": {
        "span1_index": 5, "span1_text": "x", "span2_index": 0, "span2_text": "a"}})), _examples("wsc"),
     ["record 1: span1 index 5 outside the text"]),
    ("copa-bad-question", lambda r: _sg(r, "COPA", _jl({"premise": "p", "choice1": "a", "choice2": "b",
                                                        "question": "why", "label": 0})), _examples("copa"),
     ["record 1: question 'why' is not one of cause, effect"]),
    ("multirc-passage-string", lambda r: _sg(r, "MultiRC", _jl({"idx": 0, "passage": "text"})), _examples("multirc"),
     ["MultiRC/train.jsonl: record 1: malformed record"]),
    ("multirc-answer-no-label", lambda r: _sg(r, "MultiRC", _jl({"idx": 0, "passage": {"text": "t", "questions": [
        {"question": "q", "answers": [{"text": "a"}]}]}})), _examples("multirc"), ["record 1: label None"]),
    ("cb-label-unknown", lambda r: _sg(r, "CB", _jl({"premise": "p", "hypothesis": "h", "label": "maybe"})),
     _examples("cb"), ["CB/train.jsonl: record 1: label 'maybe'"]),
    # GLUE TSV
    ("rte-missing-column", lambda r: _glue(r, "RTE", b"index\tsentence1\tlabel\n0\ta\tentailment\n"), _examples("rte"),
     ["RTE/train.tsv: header lacks column 'sentence2'"]),
    ("rte-short-row", lambda r: _glue(r, "RTE", b"index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n1\ta\n"),
     _examples("rte"), ["RTE/train.tsv: line 3: 2 fields, expected 4"]),
    ("rte-bad-label", lambda r: _glue(r, "RTE", b"index\tsentence1\tsentence2\tlabel\n0\ta\tb\tyes\n"),
     _examples("rte"), ["line 2: label 'yes' is not one of entailment, not_entailment"]),
    ("rte-empty-file", lambda r: _glue(r, "RTE", b""), _examples("rte"), ["RTE/train.tsv: empty file"]),
    ("rte-header-only", lambda r: _glue(r, "RTE", b"index\tsentence1\tsentence2\tlabel\n"), _examples("rte"),
     ["the train split of rte has no examples"]),
    ("rte-not-utf8", lambda r: _glue(r, "RTE", b"index\tsentence1\tsentence2\tlabel\n0\t\xff\tb\tentailment\n"),
     _examples("rte"), ["RTE/train.tsv: line 2: byte 34 (0xff)"]),
    ("rte-xz-truncated", lambda r: _glue(r, "RTE", _xz(b"index\tsentence1\tsentence2\tlabel\n" * 50)[:60],
                                         "train.tsv.xz"), _examples("rte"), ["train.tsv.xz: truncated"]),
    ("stsb-score-not-number", lambda r: _glue(r, "STS-B", b"sentence1\tsentence2\tscore\na\tb\thigh\n"),
     _examples("stsb"), ["STS-B/train.tsv: line 2: score 'high' is not a number"]),
    ("sst2-label-column-missing", lambda r: _glue(r, "SST-2", b"sentence\tlabels\nok\t1\n"), _examples("sst2"),
     ["header lacks column 'label'"]),
    ("cola-short-line", lambda r: _glue(r, "CoLA", b"src\t1\t\tgood\nsrc\t1\n"), _examples("cola"),
     ["CoLA/train.tsv: line 2: 2 fields, expected 4"]),
    # SQuAD JSON
    ("squad-not-json", lambda r: _squad(r, b'{"data": [\n  {"title": x}\n]}'), _examples("squad"),
     ["train-v1.1.json: line 2 column 13: not valid JSON"]),
    ("squad-truncated", lambda r: _squad(r, _squad_doc([{"paragraphs": []}])[:30]), _examples("squad"),
     ["train-v1.1.json: line 1", "not valid JSON"]),
    ("squad-top-level-list", lambda r: _squad(r, b"[1, 2]"), _examples("squad"),
     ["record 0: expected a JSON object with 'data', got list"]),
    ("squad-no-data", lambda r: _squad(r, b'{"version": "1.1"}'), _examples("squad"), ["missing field 'data'"]),
    ("squad-data-not-list", lambda r: _squad(r, b'{"data": {"a": 1}}'), _examples("squad"),
     ["'data' must be a list of articles, got dict"]),
    ("squad-no-paragraphs", lambda r: _squad(r, _squad_doc([{"title": "t"}])), _examples("squad"),
     ["train-v1.1.json: data[0]: malformed record (missing field 'paragraphs')"]),
    ("squad-qas-not-list", lambda r: _squad(r, _squad_doc([{"paragraphs": [{"context": "c", "qas": 5}]}])),
     _examples("squad"), ["data[0]: malformed record"]),
    ("squad-answer-offset-string", lambda r: _squad(r, _squad_doc([{"paragraphs": [{"context": "Ann", "qas": [
        {**SQUAD_QA, "answers": [{"text": "Ann", "answer_start": "0"}]}]}]}])), _examples("squad"),
     ["data[0]: malformed record"]),
    ("squad-answer-wrong-offset", lambda r: _squad(r, _squad_doc([{"paragraphs": [{"context": "xAnn", "qas": [
        SQUAD_QA]}]}])), _examples("squad"), ["question q1: answer 'Ann' not at offset 0"]),
    ("squad-second-article-bad", lambda r: _squad(r, _squad_doc([{"paragraphs": [{"context": "Ann", "qas": [
        SQUAD_QA]}]}, {"paragraphs": [{"qas": []}]}])), _examples("squad"), ["data[1]: malformed record",
                                                                               "'context'"]),
    ("squad-not-utf8", lambda r: _squad(r, b'{"data": [\n"\xff"]}'), _examples("squad"),
     ["train-v1.1.json: line 2: byte 12 (0xff)"]),
    ("squad-empty", lambda r: _squad(r, _squad_doc([])), _examples("squad"), ["the train split of squad has no examples"]),
    ("squad-no-answers-key", lambda r: _squad(r, _squad_doc([{"paragraphs": [{"context": "Ann", "qas": [
        {"id": "q7", "question": "who?"}]}]}])), _examples("squad"),
     ["train-v1.1.json: line 1: question q7: malformed record (missing field 'answers')"]),
    ("squad-v1-no-answer", lambda r: _squad(r, json.dumps({"data": [{"paragraphs": [{"context": "Ann", "qas": [
        SQUAD_QA, {"id": "q8", "question": "who?", "answers": []}]}]}]}, indent=1).encode()), _examples("squad"),
     ["train-v1.1.json: line 19: question q8: no answer (every SQuAD v1.1 question has one)"]),
]


@pytest.mark.parametrize("write, read, named", [pytest.param(w, r, n, id=i) for i, w, r, n in DATA_CASES])
def test_data_file_bad_input(write, read, named, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    write(root)
    before = _tree(tmp_path)
    with pytest.raises(MheError) as err:
        read(root)
    message = str(err.value)
    assert "\n" not in message
    for text in named:
        assert text in message, message
    assert _tree(tmp_path) == before


def test_truncated_gzip_in_parallel_corpus_names_file(tmp_path):
    from mhe.data.parallel_text import read_parallel

    _m30k(tmp_path, {"train.en": b"a\n"})
    (tmp_path / "multi30k" / "train.en").unlink()
    (tmp_path / "multi30k" / "train.en.gz").write_bytes(_gz(TEXT)[:150])
    with pytest.raises(MheError, match=r"train\.en\.gz: truncated compressed file"):
        read_parallel("multi30k", "train", "en", "de", data_dir=tmp_path)


def test_crlf_and_good_compressed_files_read_as_before(tmp_path):
    """The byte-level reader gives the text that text mode gave (\\r\\n -> \\n)."""
    from mhe.data.paths import iter_lines, read_text

    for name, data in (("a.txt", TEXT), ("a.txt.gz", _gz(TEXT)), ("a.txt.xz", _xz(TEXT))):
        (tmp_path / name).write_bytes(data)
        assert read_text(tmp_path / name) == TEXT.decode()
    (tmp_path / "crlf.txt").write_bytes(b"a b\r\nc\r\n\xc3\xa9\n")
    assert list(iter_lines(tmp_path / "crlf.txt")) == ["a b\n", "c\n", "\u00e9\n"]


def test_pretrain_on_truncated_corpus_saves_no_tokenizer(tmp_path, capsys):
    """Reading fails before a tokenizer is trained: nothing is saved from half a corpus."""
    data = tmp_path / "data"
    _ptb(data, _gz(TEXT)[:200], "ptb.train.txt.gz")
    (data / "ptb" / "ptb.valid.txt").write_bytes(GOOD_LINES)
    out = tmp_path / "run"
    code = main(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(data),
                 "--out", str(out), "--set", "train.steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "ptb.train.txt.gz: truncated compressed file" in err[0]
    leftovers = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert leftovers == []


# ------------------------------------------------------------------ Python API
def _build(kind="mha", **sizes):
    from mhe.attention import build_attention

    return build_attention(kind, **sizes)


def _att(kind="mha", **options):
    return _build(kind, d_model=M, n_heads=N, **options)



def _build_model(*args, **kw):
    from mhe.models import build_model

    return build_model(*args, **kw)


def _model(preset="tiny-decoder", **overrides):
    from mhe.models import build_model

    return build_model(preset, vocab_size=V, **overrides)


def _ids(b=B, t=T):
    return torch.randint(0, V, (b, t))


X = torch.randn(B, T, M)
BOOL = torch.ones(B, T, dtype=torch.bool)

# (id, call, exception type, text the message must contain)
API_CASES = [
    # build_attention
    ("att-kind-unknown", lambda: _att("foo"), MheError, "unknown attention kind 'foo'"),
    ("att-kind-case", lambda: _att("MHA"), MheError, "'MHA'"),
    ("att-d-model-zero", lambda: _build(d_model=0, n_heads=N), MheError, "d_model must be a positive integer, got 0"),
    ("att-d-model-float", lambda: _build("mha", d_model=32.0, n_heads=N), MheError, "d_model must be a positive integer, got 32.0"),
    ("att-d-model-str", lambda: _build("mha", d_model="32", n_heads=N), MheError, "d_model must be a positive integer, got '32'"),
    ("att-d-model-bool", lambda: _build("mha", d_model=True, n_heads=1), MheError, "d_model must be a positive integer, got True"),
    ("att-heads-neg", lambda: _build("mqa", d_model=M, n_heads=-1), MheError, "n_heads must be a positive integer, got -1"),
    ("att-head-dim-zero", lambda: _build(d_model=M, n_heads=N, head_dim=0), MheError, "head_dim must be a positive integer"),
    ("att-not-divisible", lambda: _build("mha", d_model=30, n_heads=4), MheError, "d_model=30 is not divisible by n_heads=4"),
    ("att-option-wrong-kind", lambda: _att("mha", n_kv_heads=2), MheError, "takes no option 'n_kv_heads'"),
    ("att-max-len-on-mha", lambda: _att("mha", max_len=16), MheError, "takes no option 'max_len'"),
    ("att-impl-on-gqa", lambda: _att("gqa", n_kv_heads=2, impl="fast"), MheError, "takes no option 'impl'"),
    ("att-typo-option", lambda: _att("mha", dropuot=0.1), MheError, "'dropuot'"),
    ("gqa-kv-not-divisor", lambda: _att("gqa", n_kv_heads=3), MheError, "n_kv_heads=3 must divide n_heads=4"),
    ("gqa-kv-negative", lambda: _att("gqa", n_kv_heads=-2), MheError, "n_kv_heads"),
    ("gqa-kv-float", lambda: _att("gqa", n_kv_heads=2.0), MheError, "n_kv_heads must be a positive integer, got 2.0"),
    ("linear-max-len-zero", lambda: _att("linear", max_len=0), MheError, "max_len must be a positive integer, got 0"),
    ("att-dropout-one", lambda: _att(dropout=1.0), MheError, "dropout must be in [0, 1), got 1.0"),
    ("att-dropout-nan", lambda: _att(dropout=float("nan")), MheError, "got nan"),
    ("att-dropout-str", lambda: _att(dropout="0.1"), MheError, "dropout must be a number in [0, 1), got '0.1'"),
    ("att-causal-str", lambda: _att(causal="yes"), MheError, "causal must be True or False, got 'yes'"),
    ("att-bias-int", lambda: _att(bias=1), MheError, "bias must be True or False, got 1"),
    ("mhe-impl-unknown", lambda: _att("mhe-mul", impl="zz"), MheError, "unknown MHE impl 'zz'"),
    ("mhe-init-std-neg", lambda: _att("mhe-add", init_std=-1.0), MheError, "init_std must be >= 0, got -1.0"),
    ("mhe-query-fold-unknown", lambda: _att("mhe-add", query_fold="x"), MheError, "unknown MHE query_fold 'x'"),
    # attention forward
    ("att-x-2d", lambda: _att()(torch.randn(T, M)), MheError, "input must have shape [B, T, d_model=32], got (7, 32)"),
    ("att-x-width", lambda: _att()(torch.randn(B, T, 16)), MheError, "got (2, 7, 16)"),
    ("att-x-int", lambda: _att()(torch.ones(B, T, M, dtype=torch.long)), MheError,
     "input must be a floating-point tensor"),
    ("att-x-list", lambda: _att()([[0.0] * M]), MheError, "input must be a torch.Tensor, got list"),
    ("att-x-float64", lambda: _att()(X.double()), MheError, "input is torch.float64 but the weights are torch.float32"),
    ("att-context-batch", lambda: _att()(X, context=torch.randn(3, 5, M)), MheError, "context must have shape [B=2"),
    ("att-context-width", lambda: _att()(X, context=torch.randn(B, 5, 8)), MheError, "context must have shape"),
    ("att-context-int", lambda: _att()(X, context=torch.ones(B, 5, M, dtype=torch.int32)), MheError,
     "context must be a floating-point tensor"),
    ("att-mask-float", lambda: _att()(X, mask=torch.ones(B, T)), MheError, "mask must be a boolean key-padding mask"),
    ("att-mask-short", lambda: _att()(X, mask=torch.ones(B, T - 1, dtype=torch.bool)), MheError, "got torch.bool (2, 6)"),
    ("att-mask-3d", lambda: _att()(X, mask=torch.ones(B, T, T, dtype=torch.bool)), MheError, "(2, 7, 7)"),
    ("mqa-x-2d", lambda: _att("mqa")(torch.randn(T, M)), MheError, "input must have shape"),
    ("mhe-mul-mask-float", lambda: _att("mhe-mul")(X, mask=torch.ones(B, T)), MheError, "mask must be a boolean"),
    ("el-att-x-float64", lambda: _att("el-att")(X.double()), MheError, "input is torch.float64"),
    ("fnet-mask-shape", lambda: _att("fnet")(X, mask=torch.ones(B, 3, dtype=torch.bool)), MheError, "mask must be"),
    ("linear-too-long", lambda: _att("linear", max_len=5)(X), MheError, "sequence length 7 exceeds"),
    ("sha-x-width", lambda: _att("sha")(torch.randn(B, T, M + 1)), MheError, "d_model=32"),
    # build_model
    ("model-preset-unknown", lambda: _model("nope"), MheError, "unknown preset 'nope'"),
    ("model-override-unknown", lambda: _model(foo=1), MheError, "unknown model setting 'foo'"),
    ("model-attention-unknown", lambda: _model(attention="zz"), MheError, "model.attention='zz' is not allowed"),
    ("model-vocab-neg", lambda: _build_model("tiny-decoder", vocab_size=-3),
     MheError, "model.vocab_size=-3 is out of range"),
    ("model-head-wrong-arch", lambda: _model(head="qa"), MheError, "unknown head for a decoder 'qa'"),
    ("model-not-a-config", lambda: _build_model(3), MheError,
     "build_model takes a preset name or a ModelConfig, got int"),
    ("model-arch-unknown", lambda: _model(arch="rnn"), MheError, "model.arch='rnn' is not allowed"),
    # model forward: ids
    ("ids-float", lambda: _model()(_ids().float()), MheError, "input_ids must hold integer token ids"),
    ("ids-bool", lambda: _model()(_ids() > 5), MheError, "got torch.bool"),
    ("ids-1d", lambda: _model()(_ids()[0]), MheError, "input_ids must have shape [B, T], got (7,)"),
    ("ids-3d", lambda: _model()(_ids()[None]), MheError, "got (1, 2, 7)"),
    ("ids-list", lambda: _model()([[1, 2, 3]]), MheError, "input_ids must be a torch.Tensor, got list"),
    ("ids-at-vocab", lambda: _model()(torch.full((B, T), V)), MheError, "input_ids holds id 99, outside the vocabulary 0..98"),
    ("ids-negative", lambda: _model()(torch.full((B, T), -1)), MheError, "input_ids holds id -1"),
    ("ids-too-long", lambda: _model()(_ids(t=129)), MheError, "sequence of 129 positions exceeds the model's max_len 128"),
    ("enc-ids-float", lambda: _model("tiny-encoder")(_ids().float()), MheError, "input_ids must hold integer"),
    ("enc-ids-at-vocab", lambda: _model("tiny-encoder")(_ids() + V), MheError, "outside the vocabulary 0..98"),
    ("enc-types-range", lambda: _model("tiny-encoder")(_ids(), token_type_ids=torch.full((B, T), 5)), MheError,
     "token_type_ids holds id 5"),
    ("enc-types-shape", lambda: _model("tiny-encoder")(_ids(), token_type_ids=torch.zeros(B, 3, dtype=torch.long)),
     MheError, "token_type_ids must have the shape of input_ids (2, 7)"),
    ("enc-types-float", lambda: _model("tiny-encoder")(_ids(), token_type_ids=torch.zeros(B, T)), MheError,
     "token_type_ids must hold integer"),
    # model forward: masks and labels
    ("mask-float", lambda: _model()(_ids(), attention_mask=torch.ones(B, T)), MheError,
     "attention_mask must be boolean or 0/1 integers"),
    ("mask-short", lambda: _model()(_ids(), attention_mask=BOOL[:, :3]), MheError,
     "attention_mask must have shape [B=2, S=7], got (2, 3)"),
    ("mask-batch", lambda: _model()(_ids(), attention_mask=torch.ones(3, T, dtype=torch.long)), MheError, "got (3, 7)"),
    ("mask-3d", lambda: _model()(_ids(), attention_mask=torch.ones(B, T, T, dtype=torch.bool)), MheError, "(2, 7, 7)"),
    ("mask-list", lambda: _model()(_ids(), attention_mask=[[1] * T] * B), MheError, "attention_mask must be a torch"),
    ("enc-mask-short", lambda: _model("tiny-encoder")(_ids(), attention_mask=BOOL[:, :2]), MheError,
     "attention_mask must have shape [B=2, S=7]"),
    ("cls-mask-float", lambda: _model(head="classification")(_ids(), attention_mask=torch.ones(B, T)), MheError,
     "attention_mask must be boolean"),
    ("labels-shape", lambda: _model()(_ids(), labels=torch.zeros(B, T - 1, dtype=torch.long)), MheError,
     "labels must have the inputs' shape (2, 7), got (2, 6)"),
    ("labels-float", lambda: _model()(_ids(), labels=torch.zeros(B, T)), MheError, "labels must hold integer"),
    ("mlm-labels-shape", lambda: _model("tiny-encoder")(_ids(), labels=torch.zeros(B, dtype=torch.long)), MheError,
     "labels must have the inputs' shape"),
    # encoder-decoder
    ("s2s-src-float", lambda: _model("tiny-encoder-decoder")(_ids().float(), _ids()), MheError,
     "src_ids must hold integer"),
    ("s2s-tgt-range", lambda: _model("tiny-encoder-decoder")(_ids(), _ids() + 200), MheError, "tgt_ids holds id"),
    ("s2s-batch", lambda: _model("tiny-encoder-decoder")(_ids(), _ids(b=1)), MheError,
     "tgt_ids has batch 1, the source (memory) has 2"),
    ("s2s-src-mask", lambda: _model("tiny-encoder-decoder")(_ids(), _ids(), src_mask=BOOL[:, :3]), MheError,
     "src_mask must have shape [B=2, S=7]"),
    ("s2s-tgt-mask", lambda: _model("tiny-encoder-decoder")(_ids(), _ids(t=5), tgt_mask=BOOL), MheError,
     "tgt_mask must have shape [B=2, S=5]"),
    ("s2s-labels", lambda: _model("tiny-encoder-decoder")(_ids(), _ids(), labels=_ids(t=3)), MheError,
     "labels must have the inputs' shape"),
    ("s2s-src-too-long", lambda: _model("tiny-encoder-decoder")(_ids(t=300), _ids()), MheError,
     "src_ids: sequence of 300 positions exceeds"),
]


@pytest.mark.parametrize("call, exc, named", [pytest.param(c, e, n, id=i) for i, c, e, n in API_CASES])
def test_api_misuse(call, exc, named):
    with pytest.raises(exc) as err:
        call()
    assert isinstance(err.value, ValueError)  # MheError is a ValueError
    message = str(err.value)
    assert "\n" not in message and named in message, message


def test_valid_inputs_still_pass():
    """The checks refuse only misuse: 0/1 integer masks, int32 ids and autocast keep working."""
    model = _model().eval()
    ids = _ids()
    ref = model(ids).logits
    assert torch.equal(model(ids.int()).logits, ref)
    assert torch.allclose(model(ids, attention_mask=torch.ones(B, T, dtype=torch.long)).logits, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _att()(X.bfloat16()).dtype == torch.bfloat16


# ------------------------------------------------------------------ real subprocesses
SUBPROCESS_CASES = [
    pytest.param(["params", "--preset", "bert-base", "--kinds", ""], "--kinds '' names no attention kind",
                 marks=pytest.mark.slow),  # a second real process; the in-process table has this case
    (["translate", "--checkpoint", "x", "--beam", "two"], "invalid int value: 'two'"),
]


@pytest.mark.parametrize("argv, named", SUBPROCESS_CASES)
def test_subprocess_one_line(argv, named, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2] / "src"), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "mhe", *argv], capture_output=True, text=True, cwd=tmp_path,
                       env=env, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr and named in lines[0], r.stderr
    assert list(tmp_path.iterdir()) == []


def test_stdin_not_utf8_names_line_and_byte(monkeypatch):
    import io

    from mhe.data.paths import read_source_lines

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\r\nthis \x96 dash\n")))
    with pytest.raises(MheError, match=r"standard input: line 2: byte 9 \(0x96\) is not UTF-8"):
        read_source_lines("-")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ok\r\n\xc3\xa9\n")))
    assert read_source_lines("-") == ["ok", "\u00e9"]


def test_table_size():
    total = len(CLI_CASES) + len(OUT_CASES) + len(DATA_CASES) + len(API_CASES) + len(SUBPROCESS_CASES)
    assert total >= 150, total
