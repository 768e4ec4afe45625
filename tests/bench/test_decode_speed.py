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


def test_a_rotary_write_row_runs_the_cache_kernel_in_sessions_of_its_own(tmp_path, monkeypatch):
    """``--rotary-write``: a row with ``kv_cache.ROTARY_WRITE`` on beside the default's (a rotary
    preset, so the kernel runs: Triton's interpreter on a CPU), the switch put back afterwards."""
    import pytest

    from mhe.attention import kv_cache, rotary_write, triton_decode

    if rotary_write.triton is None or not triton_decode.interpreting():
        pytest.skip("needs Triton's interpreter (TRITON_INTERPRET=1 on a machine without a GPU)")
    launches, launch = [], rotary_write.launch
    monkeypatch.setattr(rotary_write, "launch", lambda *a: launches.append(1) or launch(*a))
    speed.main([str(tmp_path), "--cpu-smoke", "--preset", "llama-135m", "--kinds", "gqa", "--modes", "",
                "--rotary-write", "--sections", "table", "--no-peer", "--adapter-context", "0"])
    rows = [r for r in json.loads((tmp_path / "decode-speed.json").read_text())["rows"]
            if r.get("path") == "model.generate"]
    assert [r["mode"].endswith("rotary write") for r in rows] == [False, True] * 3
    assert launches and kv_cache.ROTARY_WRITE is False
    assert all(r["ms_per_token"] > 0 for r in rows)


def test_an_inductor_tuning_row_runs_with_the_tuning_on_and_puts_it_back(tmp_path, monkeypatch):
    """``--inductor-tuning``: a row beside each default row, its calls made with inductor's
    coordinate-descent tuning on (and only its calls), the setting put back afterwards."""
    from torch._inductor import config as inductor_config

    seen, generate_row = [], speed.rows_mod.generate_row
    monkeypatch.setattr(speed.rows_mod, "generate_row",
                        lambda *a, **k: seen.append(inductor_config.coordinate_descent_tuning) or generate_row(*a, **k))
    was = inductor_config.coordinate_descent_tuning
    speed.main([str(tmp_path), "--cpu-smoke", "--kinds", "mha", "--modes", "", "--inductor-tuning",
                "--sections", "table", "--no-peer", "--adapter-context", "0"])
    rows = [r for r in json.loads((tmp_path / "decode-speed.json").read_text())["rows"]
            if r.get("path") == "model.generate"]
    assert [r["mode"].endswith("inductor tuning") for r in rows] == [False, True] * 3
    assert seen == [was, True] * 3 and inductor_config.coordinate_descent_tuning == was
    assert all(r["ms_per_token"] > 0 for r in rows)
