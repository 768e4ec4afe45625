"""benchmarks/shared_model_speed.py in its tiny CPU mode (``--dry-run``): the exported folder runs in
a Python where mhe cannot be imported, beside transformers' own Llama and mhe's ``generate``; every
row is timed, the caches are measured from their tensors, and the exported model's greedy tokens are
mhe's."""

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
SCRIPT = Path(__file__).parent.parent.parent / "benchmarks" / "shared_model_speed.py"
spec = importlib.util.spec_from_file_location("shared_model_speed", SCRIPT)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.mark.slow  # starts a Python that imports transformers (~10-40 s on a shared CPU)
def test_dry_run(tmp_path, capsys):
    out = tmp_path / "speed.json"
    assert bench.main(["--dry-run", "--shapes", "1x16", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    shape = report["shapes"]["1x16"]
    rows = shape["rows"]
    assert shape["error"] is None and shape["mhe_importable_in_child"] is False
    assert list(rows) == ["exported-static", "llama-mha", "llama-gqa", "mhe"]
    assert all(r["ms_per_token"] > 0 and r["prefill_ms"] > 0 for r in rows.values())
    assert rows["exported-static"]["module"].startswith("transformers_modules.")
    # one K/V head (tiny model: 4 query heads; GQA 2 K/V heads), from the static caches' tensors
    mha = rows["llama-mha"]["cache_bytes"]
    assert mha == 4 * rows["exported-static"]["cache_bytes"] == 2 * rows["llama-gqa"]["cache_bytes"] > 0
    assert rows["exported-static"]["same_tokens_as_mhe"] == "yes"
    assert rows["exported-static"]["tokens"] == rows["mhe"]["tokens"]
    printed = capsys.readouterr().out
    assert "Card: cpu" in printed and all(f"| {name} |" in printed for name in rows)


@pytest.mark.parametrize("shapes", ["1x4", "1", "0x64"])
def test_bad_shape_refused(shapes, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--dry-run", "--shapes", shapes])
    assert e.value.code == 2 and shapes in capsys.readouterr().err


def test_unknown_row_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--dry-run", "--rows", "exported-static,vllm"])
    assert e.value.code == 2 and "vllm" in capsys.readouterr().err
