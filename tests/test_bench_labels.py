"""``mhe bench`` in smoke sizes says what it measured: the shrunk shape, and KV caches in a unit
that shows them (they are KiB, not 0.0 MiB)."""

import json
import re

from mhe.cli import main


def test_smoke_bench_names_the_shape_and_a_readable_cache_unit(capsys, tmp_path):
    assert main(["bench", "--smoke", "--sections", "train,decode", "--kinds", "mha,mhe-mul", "--reps", "1",
                 "--presets", "gpt2-base", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    # the training section times the step alone and mhe pretrain's trainer, side by side
    rows = json.loads((tmp_path / "b.json").read_text())["training"]
    assert [(r["kind"], r["path"]) for r in rows] == [("mha", "step"), ("mha", "mhe pretrain"),
                                                      ("mhe-mul", "step"), ("mhe-mul", "mhe pretrain")]
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in rows)
    assert "every model shrunk to 2 layers, width 64" in out
    assert "2L x 64 (4 heads), vocab 512" in out  # the training rows name the shape measured
    assert "KV cache KiB" in out and "KV KiB total" in out
    cells = re.findall(r"\|\s+(\d+\.\d)\s+\|\s*$", out, flags=re.M)  # the last column of each table row
    assert cells and all(float(c) > 0 for c in cells)
