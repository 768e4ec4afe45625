"""``benchmarks/``: the README's table lists every entry point there is (and none that is gone),
and each entry point answers ``--help`` (its imports and argument parser work on a CPU)."""

import re
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = {"decode_rows.py", "decode_report.py", "train_speed_runs.py", "ddp_setups.py", "uptrain_jobs.py",
           "uptrain_stages.py", "uptrain_report.py", "toolbox.py"}


def table_tools() -> set[str]:
    text = (BENCH / "README.md").read_text()
    return set(re.findall(r"^\| `([\w.]+\.py)` \|", text, flags=re.M))


def entry_points() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py") if p.name not in MODULES)


def test_the_readme_lists_every_entry_point_and_every_module_exists():
    assert table_tools() == set(entry_points())
    assert all((BENCH / m).is_file() for m in MODULES)
    assert not list(BENCH.glob("*.sh"))  # run-books live in studies/, each in the README's table
    text = (BENCH / "README.md").read_text()
    assert {p.name for p in (BENCH / "studies").glob("*.sh")} == set(re.findall(r"`studies/([\w.-]+\.sh)`", text))


@pytest.mark.parametrize("tool", entry_points())
def test_each_entry_point_answers_help(tool, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [str(BENCH / tool), "--help"])
    monkeypatch.syspath_prepend(str(BENCH))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / tool), run_name="__main__")
    assert done.value.code in (0, None)
    assert "usage" in capsys.readouterr().out.lower()


def test_every_tool_finds_src_through_the_toolbox_alone():
    """One way to find ``src``: no tool edits ``sys.path`` itself (the exported-model benchmark's
    child must not see ``src``, so that one keeps its own ``ROOT`` and imports the toolbox late)."""
    for tool in BENCH.glob("*.py"):
        if tool.name != "toolbox.py":
            assert "sys.path" not in tool.read_text(), tool.name
