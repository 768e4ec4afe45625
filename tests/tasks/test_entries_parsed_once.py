"""Issue 59: a comparison entry (``mhe-mul psi-then-rope``) is parsed once into its
:class:`~mhe.experiments.entries.Entry`; a run's configuration built from the parsed entry looks
no kind up again (the task's defaults, the experiment's settings and the variant take the spec)."""

import pytest

from mhe.experiments.entries import entry_dir, parse_entry
from mhe.experiments.sweep import Sweep, run_config


@pytest.mark.parametrize("experiment", ["", "gpu-llama-6x512"])
def test_a_parsed_entry_builds_its_runs_without_looking_the_kind_up(kind_lookups, experiment):
    sweep = Sweep(task="lm", preset="llama-tiny", kinds=["mha", "mhe-mul psi-then-rope"], seeds=2, data="ptb",
                  experiment=experiment, overrides=["train.steps=3"])
    kind_lookups.clear()
    entry = parse_entry("mhe-mul psi-then-rope")
    assert kind_lookups["mhe-mul"] == 1
    cfgs = [run_config(sweep, entry, seed) for seed in range(2)]
    assert kind_lookups["mhe-mul"] == 1  # before issue 59's fix: 2 more lookups a run, 14 with the experiment
    assert [c.model.attention for c in cfgs] == ["mhe-mul", "mhe-mul"] and [c.train.seed for c in cfgs] == [0, 1]
    assert {c.model.attn_options.rope_order for c in cfgs} == {"psi-then-rope"}
    assert cfgs[0].model.spec is entry.spec
    text = run_config(sweep, "mhe-mul psi-then-rope", 0)  # the text, parsed once more: the same run
    assert text.identity() == cfgs[0].identity()


def test_an_entry_reads_back_as_its_text_and_folder_name():
    entry = parse_entry("  mhe-mul   psi-then-rope ")
    assert str(entry) == "mhe-mul psi-then-rope" and entry.dir == entry_dir("mhe-mul psi-then-rope")
    assert entry.dir == "mhe-mul-psi-then-rope" and str(entry.base) == "mhe-mul" and parse_entry(entry) is entry
