"""``benchmarks/results_tools.py recall-times`` (``benchmarks/records/recall_times.py``): per cell
of a recall grid, the milliseconds a step (``wall_clock.steps_s`` over the steps) and the seconds a
run (``total_s``), of every finished run or of those that chosen calls of a run-book's console
finished."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from records import recall_times  # noqa: E402


def write(folder, runs):
    """Finished runs: name -> (steps, steps_s, total_s); a clock of None writes none."""
    for name, (steps, steps_s, total_s) in runs.items():
        (folder / "runs" / name).mkdir(parents=True)
        clock = {} if steps_s is None else {"wall_clock": {"steps_s": steps_s, "total_s": total_s}}
        (folder / "runs" / name / "results.json").write_text(json.dumps({"steps": steps, "score": 0.1, **clock}))


RUNS = {"L512-d64-mha-lr0.001-seed0": (1000, 10.0, 30.0),    # 10 ms a step
        "L512-d64-sha-lr0.001-seed0": (1000, 20.0, 50.0),    # 20
        "L512-d64-mqa-lr0.001-seed0": (2000, 80.0, 100.0),   # 40
        "L512-d128-mha-lr0.001-seed0": (500, 5.0, 9.0),      # 10
        "L256-d64-mha-lr0.001-seed0": (100, None, None)}     # no clock: left out

LOG = """+ issue 60, recall (gpu-recall-zoology), 2026-11-30 00:44:22 UTC
[start] L512-d64-mha-lr0.001-seed0 on GPU 0
[done] L512-d64-mha-lr0.001-seed0: 0.1
+ issue 60, recall (gpu-recall-zoology), 2026-11-30 00:52:09 UTC
[done] L512-d64-sha-lr0.001-seed0: 0.1
[done] L512-d128-mha-lr0.001-seed0: 0.1
+ issue 60, recall (gpu-recall-zoology), 2026-11-30 01:00:10 UTC
[done] L512-d64-mqa-lr0.001-seed0: 0.1
"""


def test_a_cell_gives_the_median_and_range_of_a_step_and_a_run(tmp_path, capsys):
    """The step time is steps_s over the steps (the 2,000-step run's 80 s are 40 ms, not 80); the
    wider width comes first; a run without a clock is not counted."""
    write(tmp_path / "g", RUNS)
    assert recall_times.main([str(tmp_path / "g")]) == 0
    text = capsys.readouterr().out
    assert "| 512 | 64 | 3 | 20.0 | 10.0-40.0 | 50 | 30-100 |" in text
    assert text.index("| 512 | 128 | 1 | 10.0 | 10.0-10.0 | 9 | 9-9 |") < text.index("| 512 | 64 |")
    assert "| 256 |" not in text


def test_calls_keep_the_runs_those_calls_of_the_console_finished(tmp_path, capsys):
    """Calls count from 1 at each ``+ `` header; a ``[start]`` line is not a finished run; calls
    2-3 hold three runs, call 1 one."""
    write(tmp_path / "g", RUNS)
    (tmp_path / "log").write_text(LOG)
    assert [names for _, names in recall_times.calls_of(tmp_path / "log")] == [
        ["L512-d64-mha-lr0.001-seed0"], ["L512-d64-sha-lr0.001-seed0", "L512-d128-mha-lr0.001-seed0"],
        ["L512-d64-mqa-lr0.001-seed0"]]
    assert recall_times.main([str(tmp_path / "g"), "--log", str(tmp_path / "log"), "--calls", "2-3"]) == 0
    assert "| 512 | 64 | 2 | 30.0 | 20.0-40.0 | 75 | 50-100 |" in capsys.readouterr().out
    assert recall_times.main([str(tmp_path / "g"), "--log", str(tmp_path / "log"), "--calls", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 512 | 64 | 1 | 10.0 | 10.0-10.0 | 30 | 30-30 |" in out and "| 512 | 128 |" not in out


def test_a_run_trained_again_belongs_to_its_last_call_and_a_probes_call_to_none(tmp_path, capsys):
    """MHA's run finished in call 1 and again in call 3 (a superseded pass trained again): the
    folder holds call 3's, so call 1 has none of it. Call 4's header names another preset (a
    probe whose runs share the grid's names): with the folder's grid.json naming the grid, its
    ``[done]`` line neither counts for call 4 nor takes SHA's run from call 2."""
    write(tmp_path / "g", RUNS)
    (tmp_path / "g" / "grid.json").write_text(json.dumps({"grid": "gpu-recall-zoology"}))
    log = LOG + "[done] L512-d64-mha-lr0.001-seed0: 0.1\n" + (
        "+ issue 60, recall (gpu-recall-fresh-512), 2026-11-30 02:00:00 UTC\n[done] L512-d64-sha-lr0.001-seed0: 0.1\n")
    (tmp_path / "log").write_text(log)
    calls = recall_times.calls_of(tmp_path / "log")
    assert recall_times.runs_of_calls(calls, range(0, 1), "gpu-recall-zoology") == set()
    assert recall_times.runs_of_calls(calls, range(2, 3), "gpu-recall-zoology") == {
        "L512-d64-mqa-lr0.001-seed0", "L512-d64-mha-lr0.001-seed0"}
    assert recall_times.runs_of_calls(calls, range(1, 2), "gpu-recall-zoology") == {
        "L512-d64-sha-lr0.001-seed0", "L512-d128-mha-lr0.001-seed0"}
    assert recall_times.runs_of_calls(calls, range(1, 2), None) == {"L512-d128-mha-lr0.001-seed0"}
    with pytest.raises(SystemExit) as exit_:
        recall_times.main([str(tmp_path / "g"), "--log", str(tmp_path / "log"), "--calls", "4"])
    assert exit_.value.code == 2 and "no finished runs with a clock among calls 4" in capsys.readouterr().err


@pytest.mark.parametrize("args, says", [(["--calls", "1"], "--log and --calls go together"),
                                        (["--log", "LOG", "--calls", "4"], "the log has 3 call(s)"),
                                        (["--log", "LOG", "--calls", "2-1"], "give A or A-B"),
                                        (["--log", "missing", "--calls", "1"], "no such file")])
def test_bad_calls_are_one_line_errors(tmp_path, capsys, args, says):
    write(tmp_path / "g", RUNS)
    (tmp_path / "LOG").write_text(LOG)
    args = [str(tmp_path / a) if a in ("LOG", "missing") else a for a in args]
    with pytest.raises(SystemExit) as exit_:
        recall_times.main([str(tmp_path / "g"), *args])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_damaged_run_file_is_a_one_line_error(tmp_path, capsys):
    """A results.json that is not JSON, or whose steps are not a number, stops the command with one
    line and exit 2; a wall clock that is not an object counts as no clock."""
    write(tmp_path / "g", {"L512-d64-mha-lr0.001-seed0": (1000, 10.0, 30.0)})
    results = tmp_path / "g" / "runs" / "L512-d64-mha-lr0.001-seed0" / "results.json"
    for text in ("{not json", json.dumps({"steps": "many", "wall_clock": {"steps_s": 1.0, "total_s": 2.0}})):
        results.write_text(text)
        with pytest.raises(SystemExit) as exit_:
            recall_times.main([str(tmp_path / "g")])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "Traceback" not in err
        assert err.strip().splitlines()[-1].startswith("results_tools.py recall-times: error: ")
    results.write_text(json.dumps({"steps": 1000, "wall_clock": [1.0]}))
    with pytest.raises(SystemExit) as exit_:
        recall_times.main([str(tmp_path / "g")])
    assert exit_.value.code == 2 and "no finished runs with a clock" in capsys.readouterr().err
