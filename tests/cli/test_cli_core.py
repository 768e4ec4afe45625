"""The command line: exact paper figures, JSON, plots and one-line errors with exit code 2."""

import json
import subprocess
import sys

import pytest

from mhe.cli import main


def run(*argv):
    return subprocess.run([sys.executable, "-m", "mhe.cli", *argv], capture_output=True, text=True)


def test_params_json_bert_base(capsys):
    assert main(["params", "--preset", "bert-base", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["sha"] == 8_847_360 and got["mha"] == 28_311_552 and got["mhe-mul"] == 8_875_008


def test_params_explicit_geometry_and_arch(capsys):
    assert main(["params", "--layers", "6", "--heads", "8", "--head-dim", "64", "--arch", "encoder-decoder",
                 "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["mha"] == 18_874_368 and got["mhe-add"] == 6_515_712
    assert main(["params", "--layers", "1", "--heads", "96", "--head-dim", "128", "--arch", "decoder",
                 "--exclude-output", "--json", "--kinds", "mha,mhe-mul"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {"mha": 3 * 12288 ** 2, "mhe-mul": 3 * 12288 * 128 + 3 * 96 * 128}


def test_params_table_text(capsys):
    assert main(["params", "--preset", "transformer-base"]) == 0
    out = capsys.readouterr().out
    assert "18.87M" in out and "6.52M" in out and "| sublayers" not in out.splitlines()[0]


def test_memory_json_matches_appendix_c(capsys):
    assert main(["memory", "--preset", "bert-base", "--batch", "32", "--seq-len", "512", "--json"]) == 0
    rows = {r["kind"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["mha"]["total_bytes"] == 72_351_744 and round(rows["mhe-mul"]["saving_percent"], 2) == 44.77
    assert rows["sha"]["weights_bytes"] == 4_423_680 and rows["sha"]["adam_states_bytes"] == 5_898_240  # Table 8
    assert not any(k in r for r in rows.values() for k in ("total", "weights", "saving_ratio"))


def test_memory_table_names_its_unit(capsys):
    """MiB (2**20 bytes) with the unit in every byte column's header; GiB once a total reaches 2**30."""
    assert main(["memory", "--preset", "bert-base", "--batch", "32", "--seq-len", "512"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(line for line in lines if "kind" in line)
    assert "weights (MiB)" in head and "total (MiB)" in head and "Adam states (MiB)" in head
    mha = next(line for line in lines if line.split()[:1] == ["mha"] or line.strip("| ").startswith("mha "))
    assert f"{72_351_744 / 2 ** 20:,.2f}" in mha and "72351744" not in mha  # 69.00 MiB, as printed
    assert main(["memory", "--preset", "bert-base", "--batch", "256", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "total (GiB)" in out and "(MiB)" not in out
    assert main(["memory", "--heads", "2", "--head-dim", "16", "--batch", "1", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "total (KiB)" in out and f"{80.5:,.2f}" in out  # MHA: 82,432 bytes


def test_byte_unit_thresholds():
    from mhe.accounting.memory import byte_unit

    assert byte_unit(2 ** 20 - 1) == ("KiB", 1024) and byte_unit(2 ** 20) == ("MiB", 2 ** 20)
    assert byte_unit(2 ** 30 - 1) == ("MiB", 2 ** 20) and byte_unit(2 ** 30) == ("GiB", 2 ** 30)


def test_scaling_plot(tmp_path, capsys):
    path = tmp_path / "scaling.png"
    assert main(["scaling", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 20_000
    assert "43,486,543,872" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["params", "--preset", "nope"], "unknown preset 'nope'; valid: bert-base"),
    (["params", "--layers", "2"], "give --preset NAME or all of --layers, --heads, --head-dim"),
    (["params", "--preset", "bert-base", "--kinds", "mha,xyz"], "unknown attention kind 'xyz'"),
    (["params", "--layers", "2", "--heads", "0", "--head-dim", "64"], "n_heads must be a positive integer, got 0"),
    (["memory", "--preset", "bert-base", "--batch", "-1"], "batch must be a positive integer, got -1"),
])
def test_bad_input_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2  # in-process: a traceback would raise here
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_bad_input_from_a_real_process_has_no_traceback():
    r = run("params", "--preset", "nope")
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown preset 'nope'; valid: bert-base" in lines[0]


@pytest.mark.parametrize("rank,speaks", [("0", True), ("1", False)])
def test_under_torchrun_only_rank_0_prints_an_error_and_every_rank_exits_2(monkeypatch, capsys, tmp_path, rank,
                                                                           speaks):
    """Both kinds of bad input: a settings error (MheError) and an argument error (argparse)."""
    for key, value in {"RANK": rank, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)  # torchrun's whole environment (partial: test_refusals_newest_paths.py)
    assert main(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--out", str(tmp_path / "r"),
                 "--set", "train.steps=-1"]) == 2
    with pytest.raises(SystemExit) as exit_:
        main(["params", "--no-such-flag"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == (2 if speaks else 0), err
    if speaks:
        assert "train.steps" in err[0] and "--no-such-flag" in err[1]
