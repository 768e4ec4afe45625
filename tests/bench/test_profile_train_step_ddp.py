"""``benchmarks/train_bench.py profile`` under ``torchrun``: two gloo processes on a CPU run every
configuration together, and rank 0's report names the world size and carries each process's own
host time (gathered, not rank 0's repeated)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_profile_train_step_under_torchrun_reports_every_process(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "train_bench.py"), "profile", str(out), "--cpu-smoke"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "profile-train-step.json").read_text())
    md = (out / "profile-train-step.md").read_text()
    assert report["world"] == 2 and "world size 2" in md and "2 rows each" in md  # global batch 4 split in two
    assert report["steps"] and not report["skipped"]
    for row in report["steps"]:
        assert row["world"] == 2
        assert [p["rank"] for p in row["per_process"]] == [0, 1]  # one entry per process, by rank
        assert all(p["host_ms"] > 0 and p["wall_ms"] > 0 for p in row["per_process"])
        assert row["host_ms"] == row["per_process"][0]["host_ms"]  # the main table's figure is rank 0's
    per_process = md.split("## Per process (2 processes)")[1].split("## Differences")[0]
    table = [line for line in per_process.splitlines() if line.startswith("| tiny-")]
    assert len(table) == 2 * len(report["steps"])  # one host-ms row per process and configuration
    assert sorted(line.split(" | ")[1] for line in table) == sorted(["0", "1"] * len(report["steps"]))
