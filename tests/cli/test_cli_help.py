"""The help teaches (issue 19): every option of every command says what it does, every
command ends its --help with an example, and a bare ``mhe`` lists the commands."""

from __future__ import annotations

import argparse

import pytest

from mhe.cli import COMMANDS, build_parser, main


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_of_the_table_has_a_parser():
    assert set(_subparsers()) == set(COMMANDS)
    assert "compare" in COMMANDS  # the main job is a named command


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_help_and_the_command_an_example(name):
    p = _subparsers()[name]
    options = [a for a in p._actions if not isinstance(a, argparse._HelpAction)]
    assert options, name
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in options
               if not (a.help or "").strip() or a.help == argparse.SUPPRESS]
    assert missing == [], f"mhe {name}: options without help: {missing}"
    assert (p.epilog or "").startswith("Example:\n  ") and f"mhe {name} " in p.epilog, p.epilog
    text = p.format_help()
    assert text.rstrip().splitlines()[-1].strip().startswith(("mhe ", "echo ")), text


def test_bare_mhe_prints_the_command_list_and_exits_0(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name, cmd in COMMANDS.items():
        line = next(l for l in out.splitlines() if l.strip().startswith(name))
        assert line.split()[0] == name
    assert "compare" in out and out.startswith("usage: mhe")


def test_eval_help_names_the_real_default_stride():
    text = " ".join(_subparsers()["eval"].format_help().split())
    assert "stride 256" not in text
    assert "data.eval_stride" in text and "32 for the tiny presets" in text


def test_help_exits_0_and_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["params", "--help"])
    assert e.value.code == 0 and "Example:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_example_parses(name):
    """The examples stay valid command lines (parsed, not run)."""
    import shlex

    for line in COMMANDS[name].example.splitlines():
        argv = shlex.split(line.split("| ")[-1].strip())
        assert argv[:2] == ["mhe", name], line
        args = build_parser().parse_args(argv[1:])
        assert args.command == name


def _help_of(name: str, dest: str) -> str:
    return next(a.help for a in _subparsers()[name]._actions if a.dest == dest)


def test_help_and_errors_list_what_the_registries_hold(capsys):
    """The fine-tuning tasks, corpora and tasks in help texts and errors come from one registry
    each, so they cannot drift apart (finetune's list once lacked wnli)."""
    from mhe.data.benchmarks import BENCH_TASKS
    from mhe.data.corpora import CORPORA
    from mhe.tasks import TASKS

    tuned = _help_of("finetune", "task")
    assert all(name in tuned for name in BENCH_TASKS) and "mhe diagnostics" in tuned
    for command in ("pretrain", "train", "compare"):
        assert all(name in _help_of(command, "data") for name in CORPORA), command
    assert main(["pretrain", "--preset", "tiny-decoder"]) == 2
    assert f"pretrain needs --data ({', '.join(CORPORA)})" in capsys.readouterr().err
    trains = _help_of("train", "task")
    assert all(name in trains for name, cls in TASKS.items() if cls.command == "train")
    assert main(["train", "--task", "mt", "--preset", "tiny-encoder-decoder"]) == 2
    assert "task 'mt' has its own command: mhe train-mt" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["eval", "translate", "generate", "diagnostics", "finetune"])
def test_run_folders_are_named_run_and_checkpoint(name):
    """``--run`` and its older spelling ``--checkpoint`` name the same option, a run folder."""
    action = next(a for a in _subparsers()[name]._actions if "--run" in a.option_strings)
    assert "--checkpoint" in action.option_strings and "run folder" in action.help
