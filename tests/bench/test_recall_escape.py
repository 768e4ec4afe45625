"""``benchmarks/results_tools.py recall-escape`` (``benchmarks/records/recall_escape.py``): the first
step whose training loss is under half the plateau's ln(pairs), and per cell the runs that left
it, the median and latest such step and the share of the budget, and of the runs that stayed
their lowest last loss, how many ended above ln(pairs), how many still fell and how much of
their late fall came at epoch starts (memorising), from a grid folder or a packed archive kept
beside it."""

import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
from records import recall_escape  # noqa: E402

from mhe.experiments.run_archive import archive_bytes  # noqa: E402


def test_the_escape_step_is_the_first_loss_under_half_the_plateau():
    bar = math.log(8) / 2  # 1.04
    records = [{"step": 50, "loss": 6.0}, {"step": 100, "eval": 0.1}, {"step": 150, "loss": bar + 1e-9},
               {"step": 200, "loss": bar - 1e-9}, {"step": 250, "loss": 0.01}]
    assert recall_escape.escape_step(records, 8) == 200
    assert recall_escape.escape_step(records[:3], 8) is None


def run_files(length, width, pairs, steps, score, losses, train_size=None, batch=None):
    options = {"seq_len": length, "pairs": pairs, **({"train_size": train_size} if train_size else {})}
    config = {"run": {"data": {"task_options": options}, "model": {"d_model": width},
                      **({"train": {"batch_size": batch}} if batch else {})}, "model": {}}
    metrics = "".join(json.dumps({"step": 100 * (i + 1), "loss": x}) + "\n" for i, x in enumerate(losses))
    return {"config.json": json.dumps(config), "results.json": json.dumps({"steps": steps, "score": score}),
            "metrics.jsonl": metrics}


RUNS = {"L64-d32-mha-lr0.01-seed0": run_files(64, 32, 4, 400, 0.99, [3.0, 0.5, 0.1, 0.0]),
        "L64-d32-sha-lr0.01-seed0": run_files(64, 32, 4, 400, 0.25, [3.0, 1.4, 1.3, 1.3]),
        "L64-d32-mqa-lr0.01-seed0": run_files(64, 32, 4, 400, 0.6, [3.0, 1.4, 1.4, 0.6]),
        "L64-d32-skv-lr0.01-seed0": run_files(64, 32, 4, 400, 0.26, [3.0, 1.4, 0.6, 0.3]),  # memorised
        "L64-d64-mha-lr0.01-seed0": run_files(64, 64, 4, 400, 1.0, [0.2, 0.1, 0.0, 0.0]),
        "L64-d64-mha-lr0.01-seed1": run_files(64, 64, 4, 800, 1.0, [3.0, 3.0, 0.1, 0.0])}


def write(folder, runs):
    for name, files in runs.items():
        (folder / "runs" / name).mkdir(parents=True)
        for f, text in files.items():
            (folder / "runs" / name / f).write_text(text)


def test_a_cell_counts_its_runs_and_the_latest_escape_against_the_budget(tmp_path):
    """Per length, width and budget (a cell trained at two budgets is two rows): MHA left at 200,
    MQA at 400 of 400 steps; SHA never; SKV's loss fell but its test accuracy stayed at the
    plateau: memorised, not counted as having left."""
    write(tmp_path / "g", RUNS)
    text = recall_escape.table(recall_escape.folder_rows(tmp_path / "g"))
    assert "| 64 | 4 | 32 | 400 | 4 | 2 | 300 | 400 | 100% | 1 | 1 |" in text
    assert "| 64 | 4 | 64 | 400 | 1 | 1 | 100 | 100 | 25% | 0 | 1 |" in text
    assert "| 64 | 4 | 64 | 800 | 1 | 1 | 300 | 300 | 38% | 0 | 1 |" in text
    assert text.index("| 64 | 4 | 64 |") < text.index("| 64 | 4 | 32 |")  # the wider width first


def test_the_runs_that_stayed_give_their_lowest_last_loss_and_whether_it_still_fell(tmp_path):
    """Of the runs that neither left nor memorised: the lowest last loss, how many ended above
    ln(pairs) (ln 64 = 4.16) and how many fell by more than 1% after 80% of the steps (here the
    loss logged at step 400 of 500): one still falling short of the plateau, one flat at it, one
    flat above it; the run that left is not among them."""
    runs = {"L512-d64-mha-lr0.001-seed0": run_files(512, 64, 64, 500, 0.02, [8.0, 6.0, 5.5, 5.3, 5.2]),
            "L512-d64-sha-lr0.001-seed0": run_files(512, 64, 64, 500, 0.02, [8.0, 5.0, 4.5, 4.1, 4.1]),
            "L512-d64-mqa-lr0.001-seed0": run_files(512, 64, 64, 500, 0.01, [8.3, 8.3, 8.3, 8.3, 8.3]),
            "L512-d64-gqa-lr0.001-seed0": run_files(512, 64, 64, 500, 0.99, [8.0, 4.0, 1.0, 0.1, 0.0])}
    write(tmp_path / "g", runs)
    text = recall_escape.table(recall_escape.folder_rows(tmp_path / "g"))
    assert "| 512 | 64 | 64 | 500 | 4 | 1 | 300 | 300 | 60% | 0 | 1 | 4.10 | 2 | 1 |" in text
    assert recall_escape.end_losses([{"step": 100, "loss": 3.0}, {"step": 150, "eval": 0.5}], 150) == (3.0, 3.0)
    assert recall_escape.end_losses([{"step": 100, "loss": 3.0}, {"step": 200, "loss": 2.0}], 200) == (2.0, 3.0)
    assert recall_escape.end_losses([], 100) == (None, None)


def test_a_fall_at_epoch_starts_is_measured_against_the_intervals_that_hold_one():
    """Epochs of 250 batches, losses logged every 100 steps (steps done): step s last took batch
    s, of epoch (s - 1) // 250, so from step 200 (20% of 1,000) on the intervals (200, 300],
    (500, 600] and (700, 800] hold an epoch's first batch (3 of 8), and (900, 1000] does not
    (batch 1,000 is epoch 3's last). A loss that falls by 1.0 in those three and rises by 0.2 in
    the other five nets 2.0: 150% of it came at epoch starts. Two batches a step over epochs of
    500 batches read the same; a loss falling evenly gives the intervals' share; within one epoch
    no interval holds a start; a flat loss, or no epoch length, gives None."""
    steps = list(range(100, 1001, 100))
    records, x = [{"step": 100, "loss": 9.0}, {"step": 200, "loss": 8.0}], 8.0
    for step in steps[2:]:
        x += -1.0 if step in (300, 600, 800) else 0.2
        records.append({"step": step, "loss": x})
    assert recall_escape.epoch_share(records, 1000, 250) == pytest.approx((1.5, 3 / 8))
    assert recall_escape.epoch_share(records, 1000, 500, per_step=2) == pytest.approx((1.5, 3 / 8))
    even = [{"step": s, "loss": 10.0 - s / 100} for s in steps]
    assert recall_escape.epoch_share(even, 1000, 250) == pytest.approx((3 / 8, 3 / 8))
    assert recall_escape.epoch_share(even, 1000, 1000) == (0.0, 0.0)
    flat = [{"step": s, "loss": 5.0} for s in steps]
    assert recall_escape.epoch_share(flat, 1000, 250) is None
    assert recall_escape.epoch_share(records, 1000, None) is None


def test_the_cell_gives_the_median_share_of_its_stayed_runs_that_fell(tmp_path):
    """The column reads each run's epoch from its configuration (training sequences over the batch:
    200 batches). Logged at steps 100-500, the intervals (200, 300] and (400, 500] hold an epoch's
    first batch (2 of 4); both runs that fell did so only there (100%); the flat run is left out of
    the count."""
    runs = {f"L512-d64-{k}-lr0.001-seed0": run_files(512, 64, 64, 500, 0.02, losses, 20_000, 100)
            for k, losses in (("mha", [8.0, 8.0, 7.0, 7.0, 6.0]), ("sha", [8.0, 8.0, 7.5, 7.5, 7.0]),
                              ("mqa", [8.3] * 5))}
    write(tmp_path / "g", runs)
    text = recall_escape.table(recall_escape.folder_rows(tmp_path / "g"))
    assert "| 512 | 64 | 64 | 500 | 3 | 0 | - | - | - | 0 | 0 | 6.00 | 3 | 2 | 100% of 2 (50%) |" in text


def test_runs_without_metrics_are_named_and_without_a_configuration_refused(tmp_path):
    runs = {"L64-d32-mha-lr0.01-seed0": dict(RUNS["L64-d32-mha-lr0.01-seed0"])}
    del runs["L64-d32-mha-lr0.01-seed0"]["metrics.jsonl"]
    write(tmp_path / "g", runs)
    assert "| 64 | 4 | 32 | 400 | 1 (1 without metrics) | 0 |" in recall_escape.table(
        recall_escape.folder_rows(tmp_path / "g"))
    (tmp_path / "g" / "runs" / "L64-d32-mha-lr0.01-seed0" / "config.json").unlink()
    with pytest.raises(ValueError, match="run L64-d32-mha-lr0.01-seed0 has no readable config.json"):
        recall_escape.folder_rows(tmp_path / "g")
    with pytest.raises(SystemExit) as exit_:
        recall_escape.main([str(tmp_path / "g")])
    assert exit_.value.code == 2


def test_an_archive_kept_beside_the_grid_reads_alike(tmp_path):
    members = [(f"old/runs-old/{name}/{f}", text.encode()) for name, files in RUNS.items() for f, text in files.items()]
    (tmp_path / "old.tar.xz").write_bytes(archive_bytes(members))
    rows = recall_escape.archive_rows(tmp_path / "old.tar.xz")  # a deeper layout: the folder above results.json
    write(tmp_path / "g", RUNS)
    key = lambda r: (r["width"], r["steps"], r["score"])  # noqa: E731
    assert sorted(rows, key=key) == sorted(recall_escape.folder_rows(tmp_path / "g"), key=key)
    with pytest.raises(SystemExit):
        recall_escape.main([str(tmp_path), "--archive", str(tmp_path / "missing.tar.xz")])


def test_per_run_lists_a_run_cut_before_its_end_with_the_steps_it_logged(tmp_path, capsys):
    """A probe's run stopped by a call's deadline has no results.json: ``--per-run`` still lists
    it, with the steps it logged of its configured budget, "cut" for its accuracy, its last and
    lowest loss and its fall at epoch starts, read against its budget of 600 (epochs of 200
    batches: from step 200, past 20% of 600, the intervals (200, 300] and (400, 500] hold a start,
    2 of 3; the loss fell 1.0 in each and rose 0.5 in between: 2.0 of a 1.5 net fall, 133%). The
    finished run keeps its accuracy."""
    cut = run_files(512, 64, 64, 500, 0.0, [8.0, 7.0, 6.0, 6.5, 5.5], 20_000, 100)
    del cut["results.json"]
    config = json.loads(cut["config.json"])
    config["run"]["train"]["steps"] = 600
    cut["config.json"] = json.dumps(config)
    done = run_files(512, 64, 64, 500, 0.0191, [8.0, 8.0, 8.0, 8.0, 8.0], 20_000, 100)
    members = [(f"p/{name}/{f}", text.encode()) for name, files in
               (("L512-d64-mha-lr0.001-seed0", cut), ("L512-d64-gqa-lr0.001-seed0", done)) for f, text in files.items()]
    (tmp_path / "p.tar.xz").write_bytes(archive_bytes(members))
    assert [r["score"] for r in recall_escape.archive_rows(tmp_path / "p.tar.xz")] == [0.0191]  # finished only
    assert recall_escape.main([str(tmp_path), "--archive", str(tmp_path / "p.tar.xz"), "--per-run"]) == 0
    text = capsys.readouterr().out
    assert "| L512-d64-mha-lr0.001-seed0 | 500 | 600 | cut | 5.500 | 5.500 | 133% (67%) |" in text
    assert "| L512-d64-gqa-lr0.001-seed0 | 500 | 500 | 0.0191 | 8.000 | 8.000 | - |" in text
    with pytest.raises(SystemExit):
        recall_escape.main([str(tmp_path), "--per-run"])  # a grid folder's cut runs are not read
    assert "--per-run reads an archive" in capsys.readouterr().err


def test_per_run_reads_a_run_cut_before_its_first_log_and_skips_a_runs_own_subfolders(tmp_path, capsys):
    """A run cut before it logged a step lists 0 steps and dashes; a ``best/config.json`` inside a
    run is not a run of its own; a cut run whose configuration gives no step budget is refused in
    one line."""
    config = json.loads(run_files(512, 64, 64, 500, 0.0, [], 20_000, 100)["config.json"])
    config["run"]["train"]["steps"] = 600
    members = [("p/L512-d64-mha-lr0.001-seed0/config.json", json.dumps(config).encode()),
               ("p/L512-d64-mha-lr0.001-seed0/best/config.json", b"{}")]
    (tmp_path / "p.tar.xz").write_bytes(archive_bytes(members))
    assert [name for name, *_ in recall_escape.archive_runs(tmp_path / "p.tar.xz")] == ["L512-d64-mha-lr0.001-seed0"]
    assert recall_escape.main([str(tmp_path), "--archive", str(tmp_path / "p.tar.xz"), "--per-run"]) == 0
    assert "| L512-d64-mha-lr0.001-seed0 | 0 | 600 | cut | - | - | - |" in capsys.readouterr().out
    del config["run"]["train"]["steps"]
    (tmp_path / "q.tar.xz").write_bytes(archive_bytes([("q/L512-d64-mha-lr0.001-seed0/config.json",
                                                        json.dumps(config).encode())]))
    with pytest.raises(SystemExit) as exit_:
        recall_escape.main([str(tmp_path), "--archive", str(tmp_path / "q.tar.xz"), "--per-run"])
    assert exit_.value.code == 2 and "was cut and its config.json gives no train.steps" in capsys.readouterr().err


def test_by_entry_gives_the_best_rates_seeds_and_the_other_rates_last_losses(tmp_path, capsys):
    """Seed 0 scores 0.018 at 3e-3 and 0.020 at 1e-2 (and ties 0.020 at 3e-2): the best rate is
    1e-2, the smaller of the tie, chosen by seed 0's accuracy, not by the lower loss 3e-3 reached
    nor by seed 1's 0.9 there. Its seeds are listed in seed order with their accuracy and last loss
    (seed 2 without metrics: a dash); the other rates' last losses (every seed) give the range and
    count; a rate written with an exponent reads back alike; the wider width comes first; another
    length is left out by ``--length``; ``--out`` holds what was printed."""
    runs = {"L512-d64-mha-lr0.003-seed0": run_files(512, 64, 64, 500, 0.018, [8.0, 5.0]),
            "L512-d64-mha-lr0.01-seed0": run_files(512, 64, 64, 500, 0.020, [8.0, 6.25]),
            "L512-d64-mha-lr0.03-seed0": run_files(512, 64, 64, 500, 0.020, [8.0, 7.5]),
            "L512-d64-mha-lr0.01-seed2": run_files(512, 64, 64, 500, 0.011, [8.0, 6.0]),
            "L512-d64-mha-lr0.01-seed1": run_files(512, 64, 64, 500, 0.016, [8.0, 6.5]),
            "L512-d64-mha-lr0.003-seed1": run_files(512, 64, 64, 500, 0.9, [8.0, 5.5]),  # not seed 0: no say
            "L512-d128-mha-lr3e-05-seed0": run_files(512, 128, 64, 500, 0.015, [8.0, 7.25]),
            "L256-d64-mha-lr0.01-seed0": run_files(256, 64, 16, 500, 1.0, [3.0, 0.1])}
    del runs["L512-d64-mha-lr0.01-seed2"]["metrics.jsonl"]
    write(tmp_path / "g", runs)
    assert recall_escape.main([str(tmp_path / "g"), "--by-entry", "--length", "512",
                               "--out", str(tmp_path / "t.md")]) == 0
    text = capsys.readouterr().out
    assert "| 512 | 64 | mha | 0.01 | 3 | 0.020, 0.016, 0.011 | 6.25, 6.50, - | 5.00-7.50 (3) |" in text
    assert text.index("| 512 | 128 | mha | 3e-05 | 1 | 0.015 | 7.25 | - |") < text.index("| 512 | 64 |")
    assert "| 256 |" not in text and (tmp_path / "t.md").read_text() == text
    assert recall_escape.main([str(tmp_path / "g"), "--by-entry"]) == 0
    assert "| 256 | 64 | mha | 0.01 | 1 | 1.000 | 0.10 | - |" in capsys.readouterr().out


def test_by_entry_refuses_a_run_it_cannot_name_an_archive_and_an_empty_length(tmp_path, capsys):
    """Each a one-line error with exit 2: a length with no runs, --archive, --length alone, a run
    file without its score, and a run named otherwise than the grid names runs."""
    write(tmp_path / "g", {"L512-d64-mha-lr0.01-seed0": run_files(512, 64, 64, 500, 0.02, [8.0])})
    for bad, says in ((["--by-entry", "--length", "256"], "no finished runs of length 256"),
                      (["--by-entry", "--archive", str(tmp_path / "x.tar.xz")], "--by-entry reads the grid's folder"),
                      (["--length", "512"], "--length 512 goes with --by-entry")):
        with pytest.raises(SystemExit) as exit_:
            recall_escape.main([str(tmp_path / "g"), *bad])
        assert exit_.value.code == 2 and says in capsys.readouterr().err
    results = tmp_path / "g" / "runs" / "L512-d64-mha-lr0.01-seed0" / "results.json"
    results.write_text(json.dumps({"steps": 500}))
    with pytest.raises(SystemExit) as exit_:
        recall_escape.main([str(tmp_path / "g"), "--by-entry"])
    assert exit_.value.code == 2 and "has no 'score'" in capsys.readouterr().err
    results.write_text(json.dumps({"steps": 500, "score": 0.02}))
    (tmp_path / "g" / "runs" / "L512-d64-mha-lr0.01-seed0").rename(tmp_path / "g" / "runs" / "mha-run")
    with pytest.raises(SystemExit) as exit_:
        recall_escape.main([str(tmp_path / "g"), "--by-entry"])
    assert exit_.value.code == 2 and "run mha-run is not named as the grid names its runs" in capsys.readouterr().err
