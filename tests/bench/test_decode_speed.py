"""``benchmarks/decode.py speed`` at smoke sizes on a CPU: a ``--kernels`` row runs ``model.generate``
with that decode kernel in place of the policy's, and every row names the kernel its session ran."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).parent.parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from decoding import speed  # noqa: E402


def test_a_kernels_row_runs_the_named_kernel_beside_the_policys(tmp_path):
    speed.main([str(tmp_path), "--cpu-smoke", "--kinds", "mqa", "--modes", "", "--kernels", "eager-one-token",
                "--sections", "table", "--no-peer", "--adapter-context", "0"])
    rows = json.loads((tmp_path / "decode-speed.json").read_text())["rows"]
    ours = [r for r in rows if r.get("path") == "model.generate"]
    assert len(ours) == 2 * 3  # two rows (the policy's kernel, the named one) for each of the 3 smoke settings
    for policy, forced in zip(ours[0::2], ours[1::2]):
        assert forced["mode"].endswith("kernel eager-one-token") and forced["kernel"] == "eager-one-token"
        assert policy["kernel"] != "eager-one-token" and policy["ms_per_token"] > 0 < forced["ms_per_token"]


def test_a_rotary_step_row_runs_the_step_kernel_in_sessions_of_its_own(tmp_path, monkeypatch):
    """``--rotary-step on``: a row with ``kv_cache.ROTARY_STEP`` on beside the default's (a rotary
    preset, so the kernel runs: Triton's interpreter on a CPU), the switch put back afterwards."""
    import pytest

    from mhe.attention import kv_cache, rotary_step, triton_decode

    if rotary_step.triton is None or not triton_decode.interpreting():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 on a machine without a GPU)")
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # the default rows without it, whatever the default
    launches, launch = [], rotary_step.launch_step
    monkeypatch.setattr(rotary_step, "launch_step", lambda *a: launches.append(1) or launch(*a))
    speed.main([str(tmp_path), "--cpu-smoke", "--preset", "llama-135m", "--kinds", "gqa", "--modes", "",
                "--rotary-step", "on", "--sections", "table", "--no-peer", "--adapter-context", "0"])
    rows = [r for r in json.loads((tmp_path / "decode-speed.json").read_text())["rows"]
            if r.get("path") == "model.generate"]
    assert [r["mode"].endswith("rotary step on") for r in rows] == [False, True] * 3
    assert launches and kv_cache.ROTARY_STEP is False
    assert all(r["ms_per_token"] > 0 for r in rows)


def test_the_default_rows_keep_the_librarys_rotary_step_and_a_set_row_its_own_sessions(monkeypatch):
    """``rotary_step(None)`` (a default row) leaves ``kv_cache.ROTARY_STEP`` as the library has it and
    keeps the default sessions; ``rotary_step(on)`` sets it inside the block only and releases the
    sessions before and after, also when ``on`` is the default's setting (the row pays its compile)."""
    from mhe.attention import kv_cache
    from mhe.generation import session

    released = []
    monkeypatch.setattr(session, "release_default_sessions", lambda model: released.append(model))
    for default in (True, False):
        monkeypatch.setattr(kv_cache, "ROTARY_STEP", default)
        with speed.rotary_step(None, "model"):
            assert kv_cache.ROTARY_STEP is default and released == []
        for on in (True, False):
            with speed.rotary_step(on, "model"):
                assert kv_cache.ROTARY_STEP is on and released == ["model"]
            assert kv_cache.ROTARY_STEP is default and released == ["model"] * 2
            released.clear()
