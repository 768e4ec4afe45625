"""``benchmarks/decode.py tuning`` (``decoding/tuning.py``): the kernel-time clock is patched into
inductor's autotuner only while a row compiles, the tunings map to the step's compile options,
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


def test_profiled_tuning_times_candidates_by_kernel_time_only_inside_the_block(monkeypatch):
    """Inside ``profiled_tuning(True)`` every call of the autotuner's ``bench`` asks for the
    profiler's clock (whatever its caller asked); after the block, and with ``False``, the
    original method is back and the caller's choice goes through."""
    from torch._inductor.runtime import triton_heuristics

    seen = []

    def bench(self, launcher, *args, with_profiler=False, **kwargs):
        seen.append(with_profiler)
        return 1.0

    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "bench", bench)
    tuner = triton_heuristics.CachingAutotuner
    with tuning.profiled_tuning(True):
        tuner.bench(object(), "launcher", 3, with_profiler=False)
        tuner.bench(object(), "launcher")
    tuner.bench(object(), "launcher")
    with tuning.profiled_tuning(False):
        tuner.bench(object(), "launcher")
    assert seen == [True, True, False, False] and tuner.bench is bench


def test_tunings_map_to_the_step_s_compile_options():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert tuning.compile_options("default", cuda) is None  # the session's default: coordinate descent
    assert tuning.compile_options("profiled", cuda) is None  # the same options, another clock
    assert tuning.compile_options("off", cuda) == {}
    assert tuning.compile_options("off", cpu) == {"backend": "aot_eager"}


def test_a_bad_tuning_is_refused_in_one_line(capsys):
    with pytest.raises(SystemExit) as done:
        tuning.main(["--tunings", "default,fast"])
    err = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and err[-1] == ("decode.py tuning: error: --tunings: 'fast' is not one of "
                                                "default, profiled, off")


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
