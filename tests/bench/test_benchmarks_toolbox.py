"""``benchmarks/``: the README's table lists every entry point there is (and none that is gone), a
tool with subcommands row by row; each entry point and each subcommand answers ``--help`` (its
imports and argument parser work on a CPU); an unknown subcommand is refused in one line."""

import ast
import re
import runpy
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
MODULES = {"toolbox.py", "subcommands.py"}  # beside the entry points, not run alone
PARTS = ("train", "uptraining", "records", "decoding")  # the modules of the tools with subcommands, one folder each


def table_rows() -> set[str]:
    """The first column of the README's table: `TOOL.py` or `TOOL.py SUBCOMMAND`."""
    text = (BENCH / "README.md").read_text()
    return set(re.findall(r"^\| `([\w.]+\.py(?: [\w-]+)?)` \|", text, flags=re.M))


def entry_points() -> list[str]:
    return sorted(p.name for p in BENCH.glob("*.py") if p.name not in MODULES)


def subcommand_table(tool: str) -> dict[str, tuple[str, str]]:
    """A tool's ``SUBCOMMANDS`` table, name -> (module, what it measures), read from its source
    (nothing imported); empty for a tool without subcommands."""
    for node in ast.parse((BENCH / tool).read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "SUBCOMMANDS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def subcommands(tool: str) -> list[str]:
    return list(subcommand_table(tool))


def commands() -> list[str]:
    """Every command a user can start: each tool, and each subcommand of a tool that has them."""
    return [f"{t} {s}".strip() for t in entry_points() for s in [""] + subcommands(t)]


def test_the_readme_lists_every_entry_point_and_every_module_exists():
    assert table_rows() == {c for c in commands() if " " in c or not subcommands(c)}
    assert all((BENCH / m).is_file() for m in MODULES)
    assert len(entry_points()) <= 12, entry_points()
    assert not list(BENCH.glob("*.sh"))  # run-books live in studies/, each in the README's table
    text = (BENCH / "README.md").read_text()
    assert {p.name for p in (BENCH / "studies").glob("*.sh")} == set(re.findall(r"`studies/([\w.-]+\.sh)`", text))


def test_each_subcommand_is_a_module_of_a_parts_folder_and_no_part_runs_alone():
    named = {module for tool in entry_points() for module, _ in subcommand_table(tool).values()}
    assert named and all(m.split(".")[0] in PARTS and (BENCH / f"{m.replace('.', '/')}.py").is_file() for m in named)
    for folder in PARTS:
        assert (BENCH / folder / "__init__.py").is_file()
        assert not [p.name for p in (BENCH / folder).glob("*.py") if "__main__" in p.read_text()], folder


@pytest.mark.parametrize("command", commands())
def test_each_entry_point_and_subcommand_answers_help(command, monkeypatch, capsys):
    tool, *sub = command.split()
    monkeypatch.setattr(sys, "argv", [str(BENCH / tool), *sub, "--help"])
    monkeypatch.syspath_prepend(str(BENCH))
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH / tool), run_name="__main__")
    assert done.value.code in (0, None)
    out = capsys.readouterr().out
    assert "usage" in out.lower()
    if sub:  # the subcommand's own arguments, under its full name
        assert f"{tool} {sub[0]}" in out
    elif subcommands(tool):  # the tool lists its subcommands
        assert all(f"  {s}  " in out for s in subcommands(tool)), out


def test_an_unknown_subcommand_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))
    from toolbox import run_subcommand

    assert run_subcommand("tool.py", "what it does", {"speed": ("no.such.module", "")}, ["sped", "--x"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tool.py: unknown subcommand 'sped'; valid: speed"


def test_every_tool_finds_src_through_the_toolbox_alone():
    """One way to find ``src``: no tool or part edits ``sys.path`` itself (the exported-model
    benchmark's child must not see ``src``, so that one keeps its own ``ROOT`` and imports the
    toolbox late)."""
    for tool in BENCH.rglob("*.py"):
        if tool.name != "toolbox.py":
            assert "sys.path" not in tool.read_text(), tool.relative_to(BENCH)
