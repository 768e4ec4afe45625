"""The README's and the docs pages' Python runs as written on a CPU, and the README's statements
about what the commands print hold (the main job's expected table, the parameter totals, the
start-up without torch, whose details are in docs/commands.md).

Every ```python block of README.md and of each docs/*.md page is picked up and run on its own: a
fresh namespace in an empty working directory, so a block that leans on an import or a name from
another section fails. A block that needs an optional package (``transformers``, ``accelerate``,
``datasets``, ``peft``) is skipped when that package is absent (the ``test`` extra installs
transformers, so CI runs those blocks). The one substitution: a block that names a run folder
``runs/NAME`` finds there, under that name, a tiny run of the same task made by this suite
(``RUN_FIXTURES``: ``runs/lm-*`` is the PTB language model of tests/tiny_runs.py, ``runs/mt-*`` its
translation run), as the documented commands would have left a real one. New blocks need nothing
here unless they name another kind of run.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
COMMANDS = ROOT / "docs" / "commands.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]  # every page whose Python a reader may copy
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
OPTIONAL = ("transformers", "accelerate", "datasets", "peft")  # the optional extras of pyproject.toml
RUN_FOLDER = re.compile(r"runs/([A-Za-z0-9_.-]+)")
RUN_FIXTURES = {"lm": "lm_run", "mt": "mt_run"}  # the first word of a run folder's name -> its stand-in


def python_blocks() -> list[tuple[str, str]]:
    """("PAGE:LINE" of the opening fence, code) of every ```python block of every page."""
    blocks = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        name = page.relative_to(ROOT).as_posix()
        blocks += [(f"{name}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)) for m in BLOCK.finditer(text)]
    return blocks


def test_the_pages_have_python_blocks():
    where = [where.split(":")[0] for where, _ in python_blocks()]
    assert where.count("README.md") >= 1 and len(where) >= 8
    assert {"docs/transformers.md", "docs/generation.md"} <= set(where)  # the blocks moved out of the README


@pytest.mark.parametrize("where, code", python_blocks(), ids=[where for where, _ in python_blocks()])
def test_a_documented_block_runs_as_written(where, code, tmp_path, monkeypatch, request):
    monkeypatch.chdir(tmp_path)
    for name in sorted(set(RUN_FOLDER.findall(code))):
        fixture = RUN_FIXTURES.get(name.split("-")[0])
        assert fixture, f"{where} names runs/{name}: add a tiny run of its task to RUN_FIXTURES"
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / name).symlink_to(request.getfixturevalue(fixture), target_is_directory=True)
    try:
        exec(compile(code, where, "exec"), {"__name__": "__readme__"})
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in OPTIONAL:
            raise
        pytest.skip(f"{where} needs the optional package {e.name!r}")


def _readme_table(after: str) -> list[str]:
    """The lines of the first Markdown table after the text ``after``."""
    text = README.read_text(encoding="utf-8")
    lines = text[text.index(after):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def _range(f, *intervals):
    """(min, max) of ``f`` over the corners of the given (low, high) intervals."""
    import itertools

    values = [f(*corner) for corner in itertools.product(*intervals)]
    return min(values), max(values)


def test_the_main_jobs_expected_table_is_what_mhe_compare_prints():
    """The "Expected" block of the main job, rebuilt by the code that prints ``mhe compare``'s table
    from the README's own scores and the models' counted parameters: the header and columns, the
    kinds' order and labels and every #params equal; PRR and PEoP equal to within what the
    scores' four printed digits leave open."""
    import math

    from mhe.accounting import count_attention_params
    from mhe.experiments.presets import DEFAULT, experiment
    from mhe.experiments.summary import _label, aggregate, markdown
    from mhe.metrics import peop, prr
    from mhe.models import build_model

    table = _readme_table("Expected (one seed")
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in table[2:]]
    score = {row[0]: float(row[2]) for row in cells}
    exp = experiment(DEFAULT)
    runs = [{"attention": k, "seed": 0, "score": score[_label(k)], "metric": "accuracy", "higher_is_better": True,
             "task": exp.task, "attention_params": count_attention_params(build_model(exp.run_config(k).model))}
            for k in exp.kinds]
    printed = markdown(aggregate(runs)).splitlines()
    assert table[:2] == printed[:2]  # the header and the alignment row, as printed
    ours = [[c.strip() for c in line.split("|")[1:-1]] for line in printed[2:2 + len(cells)]]
    assert [r[:4] for r in cells] == [r[:4] for r in ours]  # kinds, #params, scores, seeds
    params = {_label(r["attention"]): r["attention_params"] for r in runs}

    def interval(label):  # the scores a four-digit print stands for
        half = 0.5 * 10 ** (math.floor(math.log10(score[label])) - 3)
        return score[label] - half, score[label] + half

    for label, _, _, _, prr_text, peop_text in cells:
        lo, hi = _range(lambda s, ref: 100 * prr(s, ref, higher_is_better=True), interval(label), interval("MHA"))
        assert lo - 0.05 <= float(prr_text) <= hi + 0.05, (label, prr_text, lo, hi)
        if label == "SHA":
            assert peop_text == "-"
            continue
        lo, hi = _range(lambda s, ref: peop(s, params[label], ref, params["SHA"], higher_is_better=True),
                        interval(label), interval("SHA"))
        assert lo - 0.005 <= float(peop_text) <= hi + 0.005, (label, peop_text, lo, hi)


def test_the_parameter_statements_are_what_mhe_params_prints(capsys):
    """BERT-base's attention 28.31M (MHA) against 8.88M (MHE); llama-135m's and llama-1.1b's published
    totals without --kinds (the preset's own kind, gqa, is in the default table)."""
    from mhe.cli import main

    text = " ".join(README.read_text(encoding="utf-8").split())
    assert "BERT-base's attention shrinks from 28.31M to 8.88M" in text
    assert main(["params", "--preset", "bert-base"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("|")}
    assert "28.31M" in rows["mha"] and "8.88M" in rows["mhe-mul"] and "8.88M" in rows["mhe-add"]
    for name, total in (("llama-135m", "134,515,008"), ("llama-1.1b", "1,100,048,384")):
        assert total in text
        assert main(["params", "--preset", name]) == 0
        assert total in capsys.readouterr().out
    assert "`mhe params --preset llama-135m` also counts" in text


def test_the_start_up_statement_names_the_commands_the_import_test_checks():
    """docs/commands.md's start-up claim lists what tests/cli/test_cli_imports.py proves imports no
    torch, and the README's one-line summary of it names no command that the claim leaves out."""
    text = COMMANDS.read_text(encoding="utf-8")
    claim = " ".join(text[text.index("## Start-up"):].split("\n## ")[0].split())
    for part in ("`mhe --help`", "`mhe COMMAND --help`", "argument errors", "setting errors", "`mhe params`",
                 "`mhe memory`", "`mhe scaling`", "tests/cli/test_cli_imports.py"):
        assert part in claim, part
    readme = " ".join(README.read_text(encoding="utf-8").split())
    summary = readme[readme.index("## Commands"):].split(" without importing torch")[0]
    assert set(re.findall(r"`mhe \w+`", summary)) <= set(re.findall(r"`mhe \w+`", claim))
