"""``benchmarks/``: the README's table lists every entry point there is (and none that is gone),
and each entry point answers ``--help`` (its imports and argument parser work on a CPU)."""

import re
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = {"train_speed_runs.py", "ddp_setups.py", "uptrain_jobs.py",
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


def test_decode_answers_help_for_every_command(capsys):
    """``decode.py``'s commands each answer ``--help`` with their own flags, an unknown one is refused."""
    monkey_path = str(BENCH)
    sys.path.insert(0, monkey_path)
    try:
        decode = runpy.run_path(str(BENCH / "decode.py"))
        for command in decode["COMMANDS"]:
            with pytest.raises(SystemExit) as done:
                decode["main"]([command, "--help"])
            assert done.value.code == 0 and f"usage: decode.py {command}" in capsys.readouterr().out
        with pytest.raises(SystemExit) as done:
            decode["main"](["flor"])
        assert done.value.code == 2 and "unknown command 'flor'" in capsys.readouterr().err
    finally:
        sys.path.remove(monkey_path)


def test_every_tool_finds_src_through_the_toolbox_alone():
    """One way to find ``src``: no tool edits ``sys.path`` itself (the exported-model benchmark's
    child must not see ``src``, so that one keeps its own ``ROOT`` and imports the toolbox late)."""
    for tool in [*BENCH.glob("*.py"), *BENCH.glob("decoding/*.py")]:
        if tool.name != "toolbox.py":
            assert "sys.path" not in tool.read_text(), tool.name
