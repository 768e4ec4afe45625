"""Benchmark readers are registered functions (no reader strings parsed on ':')."""

from __future__ import annotations

from mhe.data.bench_readers import READERS, RECORD_PARSERS, read_tsv
from mhe.data.benchmarks import BENCH_TASKS as TASKS, read_examples


def test_every_task_names_a_registered_reader():
    for name, t in TASKS.items():
        assert t.reader in READERS, name
        if t.reader == "tsv":
            assert len(t.columns) == 3 and t.columns[0] and t.columns[2], name
        if READERS[t.reader].__name__ == "read_jsonl":
            assert t.reader in RECORD_PARSERS, name


def test_a_tsv_task_reads_its_columns(tmp_path):
    d = tmp_path / "glue" / "SST-2"
    d.mkdir(parents=True)
    (d / "train.tsv").write_text("sentence\tlabel\nit works .\t1\nit does not\t0\n")
    assert READERS[TASKS["sst2"].reader] is read_tsv
    ex = read_examples("sst2", "train", data_dir=tmp_path)
    assert [(e.text_a, e.text_b, e.label) for e in ex] == [("it works .", None, 1), ("it does not", None, 0)]
