"""Issue 60's machinery: Zoology's recall layout, scoring only the queried positions, the grid
study (pooled workers, learning-rate sweep then seeds, resume, pack and report) and the paired
test across seeds."""

import json
import math
import os

import pytest
import torch

from mhe.cli import main
from mhe.errors import MheError
from mhe.experiments.grid import GridRun, Point, best_lr, edge_step, ladder
from mhe.experiments.paired import paired_rows, paired_t
from mhe.models import build_model, preset
from mhe.tasks.recall import make_zoology_recall, scored_positions


def test_zoology_layout_asks_each_key_for_its_value():
    x, y = make_zoology_recall(50, n_keys=40, n_values=40, pairs=6, queries=5, seq_len=48, seed=3)
    assert x.shape == y.shape == (50, 48)
    for row, lab in zip(x, y):
        keys, values = row[:12:2].tolist(), row[1:12:2].tolist()
        assert len(set(keys)) == 6 and all(1 <= k <= 40 for k in keys) and all(41 <= v <= 80 for v in values)
        asked = (lab != -100).nonzero().flatten().tolist()
        assert len(asked) == 5 and all(t >= 13 and (t - 12) % 2 == 1 for t in asked)
        for t in asked:  # the key before each label is a context key; the label is its value
            assert lab[t].item() == values[keys.index(row[t - 1].item())]
        others = set(range(12, 48)) - {t - 1 for t in asked}
        assert all(row[t].item() == 0 for t in others)  # padding between the queries
    again, _ = make_zoology_recall(50, n_keys=40, n_values=40, pairs=6, queries=5, seq_len=48, seed=3)
    assert torch.equal(x, again)


def test_zoology_layout_puts_most_queries_near_the_pairs():
    """Power-law distances (power_a 0.01): the first slot after the pairs is asked far more often
    than the last one."""
    _, y = make_zoology_recall(2000, n_keys=64, n_values=64, pairs=4, queries=4, seq_len=512, seed=0)
    asked = (y != -100).nonzero()[:, 1]
    first, last = int((asked == 9).sum()), int((asked >= 500).sum())
    assert first > 10 * max(last, 1)


def test_zoology_layout_refuses_a_short_sequence():
    with pytest.raises(MheError, match="seq_len >= 2 x"):
        make_zoology_recall(2, n_keys=10, n_values=10, pairs=4, queries=4, seq_len=15, seed=0)


def test_score_at_gives_the_full_logits_at_those_positions():
    torch.manual_seed(0)
    model = build_model(preset("tiny-decoder").replace(dropout=0.0, attn_dropout=0.0), vocab_size=81).eval()
    x, y = make_zoology_recall(3, n_keys=40, n_values=40, pairs=4, queries=3, seq_len=32, seed=1)
    pos, target = scored_positions(y)
    assert torch.equal(target, y[:, 1:].gather(1, pos))
    full = model(x).logits
    part = model(x, score_at=pos).logits
    ref = full.gather(1, pos[..., None].expand(-1, -1, full.shape[-1]))
    torch.testing.assert_close(part, ref, rtol=1e-5, atol=1e-5)


def test_best_lr_prefers_the_higher_score_then_the_smaller_rate():
    assert best_lr({1e-3: 0.5, 3e-3: 0.9, 1e-2: 0.7}) == 3e-3
    assert best_lr({1e-3: 0.9, 3e-3: 0.9, 1e-2: 0.1}) == 1e-3
    assert best_lr({1e-3: 0.2, 3e-3: float("nan")}) == 1e-3


def test_paired_t_against_the_closed_form():
    """Differences 2, 3, 4: mean 3, std 1, t = 3 * sqrt(3); with 2 degrees of freedom Student's
    two-sided p is 1 - t / sqrt(t^2 + 2) = 1 - sqrt(27/29)."""
    res = paired_t([5.0, 7.0, 9.0], [3.0, 4.0, 5.0])
    assert res["mean"] == pytest.approx(3.0) and res["std"] == pytest.approx(1.0) and res["df"] == 2
    assert res["t"] == pytest.approx(5.196152422706632, rel=1e-12)
    assert res["p"] == pytest.approx(1 - math.sqrt(27 / 29), rel=1e-9)
    assert res["p"] == pytest.approx(0.035098, abs=1e-6)


def test_paired_rows_name_the_better_row_by_direction():
    rows = [{"kind": "mha", "scores": [100.0, 101.0, 102.0], "std": 1.0},
            {"kind": "gqa", "scores": [98.0, 98.5, 99.5], "std": 0.76},
            {"kind": "sha", "scores": [120.0], "std": 0.0}]
    (pair,) = paired_rows(rows, higher_is_better=False)  # sha has one seed: no pair
    assert (pair["a"], pair["b"], pair["n"]) == ("mha", "gqa", 3)
    assert pair["mean"] == pytest.approx(7 / 3) and pair["better"] == "gqa"  # lower perplexity
    assert pair["beyond_spreads"] and pair["clear"] == (pair["p"] < 0.05)


def _grid(tmp_path, *extra):
    return ["compare", "--preset", "cpu-recall-zoology", "--workers", "2", "--out", str(tmp_path / "g"),
            "--set", "train.steps=2", "--set", "data.task_options.train_size=64",
            "--set", "data.task_options.test_size=20", *extra]


@pytest.mark.slow
def test_grid_chain_runs_resumes_packs_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MHE_CACHE_DIR", str(tmp_path / "cache"))
    assert main(_grid(tmp_path)) == 0
    runs = tmp_path / "g" / "runs"
    names = sorted(p.name for p in runs.iterdir())
    # 2 lengths x 2 widths x 3 entries: 2 rates at seed 0, then seed 1 at the best rate
    assert len(names) == 12 * 3 and sum(n.endswith("seed1") for n in names) == 12
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert len(summary["cells"]) == 12 and all(c["n_seeds"] == 2 for c in summary["cells"])
    for c in summary["cells"]:
        sweep = next(s for s in summary["sweep"] if (s["row"], s["length"], s["width"]) ==
                     (c["row"], c["length"], c["width"]))
        assert best_lr({float(k): v for k, v in sweep["scores"].items()}) == c["lr"]
    # a stopped chain: one seed-1 run unfinished (no results), one group's sweep unfinished
    seed1 = next(runs.glob("L64-d64-mha-*-seed1"))
    (seed1 / "results.json").unlink()
    sweep0 = runs / "L32-d32-mhe-add-lr0.01-seed0"
    for p in runs.glob("L32-d32-mhe-add-*-seed1"):
        for f in p.iterdir():
            f.unlink()
        p.rmdir()
    (sweep0 / "results.json").unlink()
    kept = {p: p.stat().st_mtime_ns for p in runs.glob("*/results.json")}
    assert main(_grid(tmp_path)) == 2  # unfinished runs: --resume needed
    capsys.readouterr()
    assert main(_grid(tmp_path, "--resume", "--finish-by", "0.001")) == 3  # every cell has a time: none fits
    assert not (seed1 / "results.json").exists() and not (sweep0 / "results.json").exists()
    assert "2 run(s) left for the next call: they could not end within the time left of --finish-by 0.001 s" \
        in capsys.readouterr().err
    assert main(_grid(tmp_path, "--resume")) == 0
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())  # finished runs not trained again
    assert (seed1 / "results.json").is_file() and (sweep0 / "results.json").is_file()
    assert len(list(runs.glob("L32-d32-mhe-add-*-seed1"))) == 1
    md = (tmp_path / "g" / "summary.md").read_text()
    assert main(["report", "--pack", str(tmp_path / "g")]) == 0
    assert not runs.exists() and (tmp_path / "g" / "runs.tar.xz").is_file()
    os.remove(tmp_path / "g" / "summary.md")
    assert main(["report", str(tmp_path / "g")]) == 0
    assert (tmp_path / "g" / "summary.md").read_text() == md
    assert (tmp_path / "g" / "recall_vs_width.png").is_file() and (tmp_path / "g" / "recall_vs_kv_cache.png").is_file()


def test_grid_refuses_finished_runs_trained_with_other_settings(tmp_path, capsys):
    """A finished run whose saved configuration, hashed by today's code, is not the one the grid
    builds for it now (the preset's steps changed since) is not read as finished: the command
    refuses the folder, naming the run and what differs. A run saved before a setting was added
    (its default on both sides) is not refused: hashed anew, the two agree."""
    from mhe.experiments.grid import run_config
    from mhe.experiments.grid_presets import GRIDS

    grid, args = GRIDS["cpu-recall-zoology"], _grid(tmp_path)
    overrides = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    state = GridRun(grid, tmp_path / "g", overrides)
    block, entry = grid.blocks[0], grid.blocks[0].entries[0]
    same, other = (Point(block, entry, 32, 4, 32, lr, 0) for lr in grid.lrs[:2])
    for p, steps in ((same, 2), (other, 7)):
        cfg = run_config(grid, p, overrides)
        cfg.train.steps = steps
        state.path(p).mkdir(parents=True)
        record = cfg.record()
        if p is same:
            assert record["train"].pop("label_smoothing") == 0.0  # as if saved before that setting existed
        (state.path(p) / "config.json").write_text(json.dumps({"run": record, "model": {}}))
        (state.path(p) / "results.json").write_text(json.dumps({"score": 0.5, "config_hash": "0" * 16}))
    assert [(p.name(), why) for p, why in state.stale()] == [(other.name(), "train.steps: 7 there, 2 now")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "1 finished run(s) trained with other settings than the grid's now" in err and other.name() in err
    assert "train.steps: 7 there, 2 now" in err
    (state.path(same) / "config.json").write_text('{"run": ')  # truncated
    (state.path(other) / "config.json").unlink()
    assert {p.name(): why.split(" (")[0] for p, why in state.stale()} == {
        same.name(): "its config.json cannot be read", other.name(): "no config.json"}
    (state.path(other) / "config.json").write_text(json.dumps({"run": {**record, "task": "lm"}, "model": {}}))
    assert dict((p.name(), why) for p, why in state.stale())[other.name()] == "task: 'lm' there, 'recall' now"


def test_grid_refuses_options_that_are_its_own(tmp_path, capsys):
    assert main(["compare", "--preset", "cpu-recall-zoology", "--kinds", "mha", "--out", str(tmp_path / "g")]) == 2
    assert "--kinds does not go with the grid preset" in capsys.readouterr().err
    assert not (tmp_path / "g").exists()


def _smallest_cell(kind="mha", *overrides):
    from mhe.experiments.grid import Point, run_config
    from mhe.experiments.grid_presets import GRIDS

    grid = GRIDS["gpu-recall-zoology"]
    return run_config(grid, Point(grid.blocks[0], kind, 64, 4, 64, 3e-3, 0), list(overrides))


def test_recall_grid_trains_as_zoology_does():
    """What lets MHA leave the recall plateau within the grid's steps (the preset's calibration):
    attention-only layers, Zoology's batches and weight decay, at Zoology's vocabulary; the
    lengths from 256 on compiled (RECALL_COMPILED_FROM), the shorter ones as they ran."""
    from mhe.experiments.grid import Point, run_config
    from mhe.experiments.grid_presets import GRIDS

    grid = GRIDS["gpu-recall-zoology"]
    batches, compiled = {}, {}
    for block in grid.blocks:
        for length, pairs in grid.cells:
            cfg = run_config(grid, Point(block, block.entries[0], length, pairs, 512, 1e-2, 0))
            compiled[length] = cfg.train.compile
            assert cfg.model.mlp == "none" and cfg.model.dropout == 0.0 and cfg.train.weight_decay == 0.1
            o = cfg.data.task_options
            assert o.n_keys + o.n_values + 1 == 8192 and o.queries == o.pairs == pairs and o.seq_len == length
            batches[length] = cfg.train.batch_size
            model = build_model(cfg.model, vocab_size=8192)
            assert not any(".ffn" in name for name, _ in model.named_parameters())
    assert batches == {64: 512, 128: 512, 256: 256, 512: 128}
    assert compiled == {64: False, 128: False, 256: True, 512: True}  # the pool's measured lever, from 256 on


def test_the_fresh_data_probe_is_the_grid_s_length_512_run_on_more_sequences(tmp_path):
    """``gpu-recall-fresh-512`` runs four of the grid's length-512 runs (width 512, lr 1e-3, seed
    0; nothing follows them) and must differ from them in the training set's size alone, one
    sequence a batch row of the whole run, or its answer would not be about the data."""
    import dataclasses

    from mhe.experiments.grid import GridRun, run_config
    from mhe.experiments.grid_presets import GRIDS

    probe, grid = GRIDS["gpu-recall-fresh-512"], GRIDS["gpu-recall-zoology"]
    todo = GridRun(probe, tmp_path).todo()
    assert [p.name() for p in todo] == [
        "L512-d512-mha-lr0.001-seed0", "L512-d512-gqa-lr0.001-seed0", "L512-d512-mqa-lr0.001-seed0",
        "L512-d512-rotary-mhe-mul-rope-then-psi-lr0.001-seed0"]
    assert probe.seeds == 1 and probe.extend == 0
    for p in todo:
        ours = run_config(probe, p)
        theirs = run_config(grid, dataclasses.replace(p, block=next(b for b in grid.blocks if b.name == p.block.name)))
        assert ours.data.task_options.train_size == 9000 * 128 == ours.train.steps * ours.train.batch_size
        assert theirs.data.task_options.train_size == 100_000
        ours.data.task_options = dataclasses.replace(ours.data.task_options, train_size=100_000)
        assert ours.to_dict() == theirs.to_dict()


@pytest.mark.slow
def test_mha_leaves_the_recall_plateau_at_the_smallest_cell(tmp_path, monkeypatch):
    """MHA at length 64, 4 pairs, width 64 (4 heads of 16), vocabulary 8,192, trained as the grid
    trains it for 600 steps, answers most queries; a model that only knows the answer is one of
    the 4 listed values scores about 0.25 (the plateau the grid's earlier settings measured).
    About 5 minutes on one CPU thread."""
    from mhe.tasks.runs import run_training

    monkeypatch.setenv("MHE_CACHE_DIR", "off")
    cfg = _smallest_cell("mha", "train.steps=600", "train.warmup_steps=60")
    res = run_training(cfg, tmp_path / "run", log=lambda m: None)
    assert res["score"] >= 0.85


def test_the_grid_figure_names_every_row_of_every_panel(tmp_path):
    """The legend lists each row once, whichever lengths it ran at: a grid whose longest length
    has run only MHA so far still names MHE-Mul's and SHA's lines of the shorter one (the legend
    was once the last panel's alone)."""
    from mhe.experiments.grid_report import plot_grid
    from mhe.experiments.plots import label

    cell = lambda row, length, width: {"row": row, "length": length, "pairs": length // 16, "width": width,  # noqa: E731
                                        "mean": 0.5, "std": 0.1, "kv_cache_bytes_per_token": width * 8}
    rows = ["mha", "sha", "mhe-mul"]
    cells = [cell(r, 64, w) for r in rows for w in (64, 128)] + [cell("mha", 128, 128)]
    names = plot_grid({"cells": cells}, tmp_path / "f.png", x="width")
    assert sorted(names) == sorted(label(r) for r in rows) and len(names) == 3
    assert (tmp_path / "f.png").stat().st_size > 0


def test_ladder_and_edge_step_bracket_the_best_rate():
    assert [ladder(1e-2, 1), ladder(1e-3, -1), ladder(3e-4, -1), ladder(3e-3, 1)] == [3e-2, 3e-4, 1e-4, 1e-2]
    assert edge_step({1e-3: 0.9, 3e-3: 0.5, 1e-2: 0.1}) == -1
    assert edge_step({1e-3: 0.2, 3e-3: 0.5, 1e-2: 0.9}) == 1
    assert edge_step({1e-3: 0.2, 3e-3: 0.9, 1e-2: 0.5}) == 0  # inside: bracketed
    assert edge_step({1e-3: 1.0, 3e-3: 1.0, 1e-2: 0.1}) == 0  # a flat top: no rate to add


def test_sweep_adds_a_rate_past_the_edge_its_best_lies_on(tmp_path):
    """``Grid.extend``: a finished sweep whose best is its highest rate runs the next rate up (once,
    handed out once), and the seeds follow at the best of the widened sweep; a flat top adds none."""
    from dataclasses import replace

    from mhe.experiments.grid_presets import GRIDS

    grid = replace(GRIDS["cpu-recall-zoology"], lrs=(1e-3, 3e-3, 1e-2), seeds=3, extend=2)
    state = GridRun(grid, tmp_path)
    block, entry = grid.blocks[0], grid.blocks[0].entries[0]
    group = (block, entry, 32, 4, 32)

    def finish(lr, score, seed=0):
        d = state.path(Point(*group, lr, seed))
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"score": score}))
    for lr, score in ((1e-3, 0.2), (3e-3, 0.5), (1e-2, 0.8)):
        finish(lr, score)
    assert [p.lr for p in state.sweep(*group)] == [1e-3, 3e-3, 1e-2, 3e-2]
    assert state.seeds_of(*group) == []  # the added rate first
    last = Point(*group, 1e-2, 0)
    assert [p.name() for p in state.next_after(last)] == [Point(*group, 3e-2, 0).name()]
    assert state.next_after(last) == []  # handed out once
    finish(3e-2, 0.9)  # the best again, at the new edge: one more (extend=2), then no more
    assert [p.lr for p in state.sweep(*group)] == [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
    finish(1e-1, 0.3)
    assert [(p.lr, p.seed) for p in state.next_after(Point(*group, 1e-1, 0))] == [(3e-2, 1), (3e-2, 2)]
    flat = (block, entry, 32, 4, 64)
    for lr, score in ((1e-3, 1.0), (3e-3, 1.0), (1e-2, 0.4)):
        d = state.path(Point(*flat, lr, 0))
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"score": score}))
    assert [p.lr for p in state.sweep(*flat)] == [1e-3, 3e-3, 1e-2]
    assert [(p.lr, p.seed) for p in state.seeds_of(*flat)] == [(1e-3, 1), (1e-3, 2)]


def test_todo_finishes_a_length_before_the_next_seeds_first(tmp_path):
    """A call's queue goes length by length: the seeds left over at the shortest length (its sweep
    done, a seed stopped by the last call's deadline) come before any run of the next length, and
    within a length the seeds of finished sweeps come before the sweeps still to run. The old order
    (every sweep of every length, then the seeds) left such a seed behind all longer lengths."""
    from dataclasses import replace

    from mhe.experiments.grid_presets import GRIDS

    grid = replace(GRIDS["cpu-recall-zoology"], extend=0)
    state = GridRun(grid, tmp_path)
    block, entry = grid.blocks[0], grid.blocks[0].entries[0]
    done = (block, entry, 32, 4, 32)
    for lr in grid.lrs:
        d = state.path(Point(*done, lr, 0))
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"score": lr}))  # the highest rate is best
    todo = state.todo()
    lengths = [p.length for p in todo]
    assert lengths == sorted(lengths) and lengths[-1] == 64  # length 32 whole, then length 64
    first = todo[0]
    assert (first.group, first.lr, first.seed) == (("", entry, 32, 32), max(grid.lrs), 1)
    at32 = [p for p in todo if p.length == 32]
    seeds = [i for i, p in enumerate(at32) if p.seed > 0]
    assert seeds == list(range(len(seeds))) and len(seeds) == grid.seeds - 1  # seeds first, then sweeps
    assert not any(p.group == first.group and p.seed == 0 for p in todo)  # its sweep is done


def test_run_durations_expect_the_median_of_a_cell_s_finished_runs(tmp_path):
    """A run's expected time is the median ``wall_clock.total_s`` of the finished runs of its
    sequence length and width (any entry, rate or seed); results without a clock are skipped; a
    cell with none expects its length's slowest cell, or the longest shorter length's slowest
    scaled by the lengths and their steps, or nothing where no shorter length ran (such a run starts); and a run
    that finishes counts at once."""
    import functools
    from dataclasses import replace

    from mhe.experiments.grid import RunDurations
    from mhe.experiments.grid_presets import GRIDS, recall_zoology

    grid = GRIDS["cpu-recall-zoology"]
    state = GridRun(grid, tmp_path)
    block = grid.blocks[0]

    def finish(entry, width, lr, seconds):
        d = state.path(Point(block, entry, 32, 4, width, lr, 0))
        d.mkdir(parents=True)
        (d / "results.json").write_text(json.dumps({"score": 0.5, **({"wall_clock": {"total_s": seconds}}
                                                                      if seconds is not None else {})}))
    finish("mha", 32, 3e-3, 10.0)
    finish("mhe-add", 32, 3e-3, 30.0)
    finish("mhe-add", 32, 1e-2, None)  # no clock: skipped
    finish("mha", 64, 3e-3, 99.0)
    short = state.path(Point(block, "mha", 16, 2, 32, 3e-3, 0))
    short.mkdir(parents=True)  # L16: shorter than 32, so not the length a longer one is judged by
    (short / "results.json").write_text(json.dumps({"wall_clock": {"total_s": 500.0}}))
    rotary = state.path(Point(grid.blocks[1], grid.blocks[1].entries[0], 32, 4, 32, 1e-3, 0))
    rotary.mkdir(parents=True)  # L32-d32-rotary-...: its start-up (paid once a worker) left out
    (rotary / "results.json").write_text(json.dumps({"wall_clock": {"total_s": 45.0, "startup_s": 5.0}}))
    odd = state.path(Point(block, "mha", 32, 4, 32, 3e-2, 0))
    odd.mkdir(parents=True)
    (odd / "results.json").write_text('{"wall_clock": {"total_s": NaN}}')  # not a time: skipped
    durations = RunDurations(state)
    assert durations.expected(Point(block, "mha", 32, 4, 32, 1e-2, 1)) == 30.0  # median of 10, 30, 40
    longer = replace(grid, configure=functools.partial(recall_zoology, steps={32: 20, 64: 70}, batch={32: 16, 64: 16}))
    assert RunDurations(GridRun(longer, tmp_path)).expected(Point(block, "mha", 64, 8, 32, 1e-2, 0)) == 693.0  # x 3.5
    assert durations.expected(Point(block, "mha", 32, 4, 48, 1e-2, 0)) == 99.0  # no run at its width: slowest
    assert durations.expected(Point(block, "mha", 64, 8, 32, 1e-2, 0)) == 198.0  # of length 32, twice as long
    assert durations.expected(Point(block, "mha", 8, 1, 32, 1e-2, 0)) is None  # nothing as short
    finish("mha", 32, 1e-2, 11.0)
    durations.add(Point(block, "mha", 32, 4, 32, 1e-2, 0))
    assert durations.expected(Point(block, "mhe-add", 32, 4, 32, 3e-3, 2)) == 20.5  # 10, 11, 30, 40


@pytest.mark.parametrize("elapsed, expected, finish_by, starts", [
    (0.0, None, 100.0, True),      # nothing known of its cell: it starts
    (99.0, None, 100.0, True),
    (60.0, 40.0, 100.0, True),     # ends on time
    (61.0, 40.0, 100.0, False),    # would be cut: waits for the next call
    (5.0, 150.0, 100.0, True),     # longer than any call: starts early, ends by being resumed
    (11.0, 150.0, 100.0, False),   # ... but not past the first tenth
    (500.0, 40.0, None, True),     # no deadline
])
def test_may_start_admits_runs_that_end_in_time(elapsed, expected, finish_by, starts):
    from mhe.experiments.grid import may_start

    assert may_start(elapsed, expected, finish_by) is starts
