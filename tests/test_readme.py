"""The README's Python runs as written on a CPU.

Every ```python block of README.md is picked up and run on its own: a fresh namespace in an
empty working directory, so a block that leans on an import or a name from another section
fails. A block that needs an optional package (``transformers``, ``accelerate``, ``datasets``, ``peft``)
is skipped when that package is absent (the ``test`` extra installs transformers, so CI runs
those blocks). The one substitution: a
block that names a run folder ``runs/NAME`` finds there, under that name, a tiny run of the same
task made by this suite (``RUN_FIXTURES``: ``runs/lm-*`` is the PTB language model of
tests/tiny_runs.py, ``runs/mt-*`` its translation run), as the README's own commands would
have left a real one. New blocks need nothing here unless they name another kind of run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
OPTIONAL = ("transformers", "accelerate", "datasets", "peft")  # the optional extras of pyproject.toml
RUN_FOLDER = re.compile(r"runs/([A-Za-z0-9_.-]+)")
RUN_FIXTURES = {"lm": "lm_run", "mt": "mt_run"}  # the first word of a run folder's name -> its stand-in


def python_blocks() -> list[tuple[int, str]]:
    """(line of the opening fence, code) of every ```python block of the README."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("line, code", python_blocks(), ids=[f"README.md:{n}" for n, _ in python_blocks()])
def test_a_readme_block_runs_as_written(line, code, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    for name in sorted(set(RUN_FOLDER.findall(code))):
        fixture = RUN_FIXTURES.get(name.split("-")[0])
        assert fixture, f"README.md:{line} names runs/{name}: add a tiny run of its task to RUN_FIXTURES"
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / name).symlink_to(request.getfixturevalue(fixture), target_is_directory=True)
    try:
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"README.md:{line} needs the optional package {e.name!r}")
