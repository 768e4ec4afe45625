"""The paper's published numbers (Tables 1-3), kept as data with their source."""

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


def paper_table(name: str) -> dict:
    """``{"metric", "higher_is_better", "rows": {kind: [params_M, score]}}``."""
    tables = _data()["tables"]
    if name not in tables:
        raise one_of("paper table", name, tables)
    return tables[name]


def source() -> str:
    return _data()["source"]
