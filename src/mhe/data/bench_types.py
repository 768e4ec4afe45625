"""The records and task descriptions of the fine-tuning benchmarks (GLUE, SuperGLUE, SQuAD)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Example:
    text_a: str
    text_b: str | None = None
    label: float | int | None = None
    group: str = ""  # MultiRC question id
    choices: list = field(default_factory=list)  # COPA alternatives
    uid: str = ""
    answers: list = field(default_factory=list)  # SQuAD: [(text, char_start)]


@dataclass(frozen=True)
class BenchTask:
    """One task: its label names (in id order; empty for regression and spans), its files per
    split (relative paths without .gz/.xz; a list of lists is a list of alternatives) and its
    reader, a key of :data:`mhe.data.bench_readers.READERS` (``columns``: the TSV reader's
    first-text, second-text ("" for none) and label columns)."""

    name: str
    benchmark: str  # glue | superglue | squad
    kind: str  # classification | regression | choice | span | diagnostic
    labels: tuple
    files: dict
    reader: str
    columns: tuple = ()
