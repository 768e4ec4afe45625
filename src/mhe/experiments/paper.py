"""The paper's published numbers kept as data, each with the table it comes from.

``tables`` hold one score per attention kind (Tables 1-3 and the per-task rows of
Appendix A), the shape ``mhe report`` sets beside a comparison. ``appendix`` holds
the appendix tables whole: per-task GLUE/SuperGLUE with standard deviations and
the (M) rows (Appendix A), their PEoP tables, memory usage (Appendix C) and the
size-scaling tables (Appendix D), each naming its LaTeX label in ``table``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from mhe.errors import one_of


@lru_cache(maxsize=1)
def _data() -> dict:
    return json.loads((Path(__file__).with_name("paper_results.json")).read_text())


def paper_tables() -> list[str]:
    return list(_data()["tables"])


def _table(section: str, name: str, what: str) -> dict:
    tables = _data()[section]
    if name not in tables:
        raise one_of(what, name, tables)
    return tables[name]


def paper_table(name: str) -> dict:
    """``{"metric", "higher_is_better", "rows": {kind: [params_M or None, score]}}``."""
    return _table("tables", name, "paper table")


def appendix_tables() -> list[str]:
    return list(_data()["appendix"])


def appendix_table(name: str) -> dict:
    """One appendix table as printed: ``{"table": its label, "note", ...}`` (see the module doc)."""
    return _table("appendix", name, "appendix table")


def source() -> str:
    return _data()["source"]
