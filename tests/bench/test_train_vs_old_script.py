"""``benchmarks/train_bench.py vs-old`` (``benchmarks/train/vs_old.py``): the verdict read off the runs (new/old against the larger spread of
one tree's repeats), and an older tree's runs really use that tree's package."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from train import runs as train_speed_runs  # noqa: E402
from train import vs_old as train_vs_old  # noqa: E402


def rows(new, old):
    return [{"preset": "p", "kind": "mha", "tree": t, "repeat": i, "tokens_per_s": v}
            for t, values in (("new", new), ("old", old)) for i, v in enumerate(values)]


def verdict(new, old):
    return train_vs_old.table(rows(new, old))[-1].split("|")[-2].strip()


def test_the_ratio_is_read_against_the_larger_spread():
    assert verdict([100, 104], [101, 102]) == "within noise"    # 1.02 <= spread 1.04
    assert verdict([110, 111], [100, 101]) == "faster"          # 1.10 > 1.01
    assert verdict([90, 91], [100, 101]) == "slower"
    assert verdict([100], [101]) == "one run each: no noise estimate"
    assert verdict([100, None], []) == "not measured"
    line = train_vs_old.table(rows([100, 104], [101, 102]))[-1]
    assert "| 1.040 | 1.005 |" in line  # spread 104/100; median 102 over median 101.5


def test_an_older_trees_run_gets_that_tree_on_pythonpath(tmp_path, monkeypatch):
    seen = {}

    class Done:
        pid = 0

        def wait(self, timeout=None):
            return 0

    def popen(args, env, **_):
        seen["path"] = env["PYTHONPATH"]
        return Done()

    monkeypatch.setattr(train_speed_runs.subprocess, "Popen", popen)
    (tmp_path / "logs").mkdir()
    runner = train_speed_runs.Runner(tmp_path, "data", 100)
    runner.run("old", ["pretrain"], src=tmp_path / "old-src")
    assert seen["path"] == str(tmp_path / "old-src")
    runner.run("new", ["pretrain"])
    assert seen["path"].split(":")[0] == str(train_speed_runs.ROOT / "src")
