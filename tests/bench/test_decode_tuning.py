"""``benchmarks/decode.py tuning`` (``decoding/tuning.py``): an event-clock row turns the session's kernel-time
clock off only while it compiles, the tunings map to the step's compile options,
a bad tuning is refused in one line, and a CPU smoke run writes a row per kind, tuning and
repeat."""

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parent.parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from decoding import tuning  # noqa: E402


def test_the_event_clock_row_turns_the_kernel_time_clock_off_only_inside_the_block():
    """``event-clock`` rows compile with ``KERNEL_TIME_TUNING`` off (inductor's own clock), and the
    setting is back afterwards, also when the row fails; other rows leave it on."""
    from mhe.generation import step

    assert step.KERNEL_TIME_TUNING is True
    with tuning.event_clock(True):
        assert step.KERNEL_TIME_TUNING is False
    with tuning.event_clock(False):
        assert step.KERNEL_TIME_TUNING is True
    with pytest.raises(RuntimeError), tuning.event_clock(True):
        raise RuntimeError("a row that failed")
    assert step.KERNEL_TIME_TUNING is True


def test_a_rotation_row_sets_its_switch_only_inside_the_block(tmp_path, monkeypatch):
    """``--rotations separate,kernel``: a row per rotation, the kernel one computed with
    ``kv_cache.ROTARY_STEP`` on, the switch as it was after it (also when a row fails)."""
    from mhe.attention import kv_cache

    seen = []
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # whatever the default

    def one_row(*args, **kw):
        seen.append(kv_cache.ROTARY_STEP)
        return {"ms_a_token": 1.0, "decode_ms_a_step": 1.0, "first_call_s": 1.0, "kernels_per_token": 1,
                "counted": "ops", "busy_us_per_token": 0.0}
    monkeypatch.setattr(tuning, "one_row", one_row)
    out = tmp_path / "rows.json"
    assert tuning.main(["--smoke", "--kinds", "gqa", "--tunings", "default", "--rotations", "separate,kernel",
                        "--repeats", "1", "--json", str(out)]) == 0
    assert seen == [False, True] and kv_cache.ROTARY_STEP is False
    assert [r["rotation"] for r in json.loads(out.read_text())["rows"]] == ["separate", "kernel"]
    with pytest.raises(RuntimeError), tuning.rotating_step(True):
        raise RuntimeError("a row that failed")
    assert kv_cache.ROTARY_STEP is False
    with pytest.raises(SystemExit):
        tuning.main(["--smoke", "--rotations", "joint"])


def test_tunings_map_to_the_step_s_compile_options():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tuning.compile_options("default", cuda) is None  # the session's default: coordinate descent
    assert tuning.compile_options("event-clock", cuda) is None  # the same options, another clock
    assert tuning.compile_options("off", cuda) == {}
    assert tuning.compile_options("off", cpu) == {"backend": "aot_eager"}


def test_a_bad_tuning_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        tuning.main(["--tunings", "default,fast"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err[-1] == ("decode.py tuning: error: --tunings: 'fast' is not one of "
                                                "default, event-clock, off")


def test_a_bad_kernel_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        tuning.main(["--smoke", "--kernels", "auto,splitk"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err[-1].startswith("decode.py tuning: error: --kernels: unknown attention "
                                                       "kernel 'splitk'; valid: sdpa")


def test_each_kernel_named_is_a_row_of_its_own(tmp_path, monkeypatch):
    """``--kernels auto,eager``: a row per kernel, the named one handed to ``model.generate`` (the
    session's own choice for ``auto``)."""
    asked = []

    def one_row(model, ids, mask, dev, tuning_name, new, reps, top, kernel="auto"):
        asked.append(kernel)
        return {"ms_a_token": 1.0, "decode_ms_a_step": 1.0, "first_call_s": 1.0, "kernels_per_token": 1,
                "counted": "ops", "busy_us_per_token": 0.0}
    monkeypatch.setattr(tuning, "one_row", one_row)
    out = tmp_path / "rows.json"
    assert tuning.main(["--smoke", "--kinds", "mha", "--tunings", "default", "--kernels", "auto,eager", "--repeats",
                        "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert asked == ["auto", "eager"] and [r["kernel"] for r in rows] == ["auto", "eager"]


def test_the_cpu_smoke_writes_a_row_per_kind_tuning_and_repeat(tmp_path):
    out = tmp_path / "rows.json"
    caches_off = torch._inductor.config.force_disable_caches
    assert tuning.main(["--smoke", "--kinds", "mha", "--tunings", "default,off", "--repeats", "1", "--reps", "1",
                        "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["device"] == "CPU" and [(r["kind"], r["tuning"], r["repeat"]) for r in got["rows"]] == \
        [("mha", "default", 0), ("mha", "off", 0)]
    for r in got["rows"]:
        assert r["ms_a_token"] > 0 and r["first_call_s"] > 0 and r["kernels_per_token"] > 0
    assert torch._inductor.config.force_disable_caches is caches_off  # the caches are off for the rows only


def test_the_rotation_rows_default_to_the_librarys_setting(tmp_path, monkeypatch):
    """Without ``--rotations`` the rows compile as the library decodes: with ``ROTARY_STEP`` on, a
    ``kernel`` row with the switch on; off, a ``separate`` row with it off."""
    from mhe.attention import kv_cache

    seen = []

    def one_row(*args, **kw):
        seen.append(kv_cache.ROTARY_STEP)
        return {"ms_a_token": 1.0, "decode_ms_a_step": 1.0, "first_call_s": 1.0, "kernels_per_token": 1,
                "counted": "ops", "busy_us_per_token": 0.0}
    monkeypatch.setattr(tuning, "one_row", one_row)
    for library, rotation in ((True, "kernel"), (False, "separate")):
        monkeypatch.setattr(kv_cache, "ROTARY_STEP", library)
        seen.clear()
        out = tmp_path / f"{rotation}.json"
        assert tuning.main(["--smoke", "--kinds", "gqa", "--tunings", "default", "--repeats", "1",
                            "--json", str(out)]) == 0
        assert seen == [library] and kv_cache.ROTARY_STEP is library
        assert [r["rotation"] for r in json.loads(out.read_text())["rows"]] == [rotation]
