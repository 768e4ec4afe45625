"""Issue 59: the accounting commands parse ``--kinds`` into specs once and look no kind up again
(``mhe params``, ``mhe memory``), and the scaling curves look each kind up once, not once per
head count."""

import json

from mhe.accounting.scaling import params_vs_heads
from mhe.cli import main


def test_mhe_params_and_memory_look_each_kind_up_once(kind_lookups, capsys):
    kind_lookups.clear()
    assert main(["params", "--preset", "llama-135m", "--kinds", "mha,gqa,mhe-mul", "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)
    assert list(totals) == ["mha", "gqa", "mhe-mul"]
    assert totals["gqa"] == 30 * (576 * 576 + 2 * 576 * 3 * 64 + 576 * 576)  # the preset's 3 K/V heads
    assert kind_lookups["mhe-mul"] == 1 and kind_lookups["gqa"] == 2  # --kinds, and the preset's own kind
    kind_lookups.clear()
    assert main(["memory", "--preset", "gpt2-base", "--kinds", "mqa,mhe-add"]) == 0
    out = capsys.readouterr().out
    assert "mhe-add" in out and "K/V heads cached" in out  # the whole-model table too
    assert kind_lookups["mqa"] == 1 and kind_lookups["mhe-add"] == 1


def test_the_scaling_curves_look_each_kind_up_once(kind_lookups):
    kind_lookups.clear()
    curves = params_vs_heads(range(1, 129), 64, kinds=("mha", "sha"))
    assert kind_lookups["mha"] == 1 and kind_lookups["sha"] == 1  # not 128 times each
    assert curves["mha"][7] == 3 * (8 * 64) ** 2 and curves["sha"][7] == 3 * 8 * 64 * 64
