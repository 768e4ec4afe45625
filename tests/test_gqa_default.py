"""One GQA default group count (n/4, attention.multi_head.default_kv_heads) for models,
`mhe params` and `mhe memory`."""

import json

import pytest

from mhe.accounting import count_attention_params, model_attention_params
from mhe.attention.multi_head import GroupedQueryConfig, default_kv_heads
from mhe.cli import main
from mhe.models import build_model


@pytest.mark.parametrize("n,g", [(1, 1), (4, 1), (6, 1), (8, 2), (12, 3), (16, 4), (32, 8), (20, 5)])
def test_default_kv_heads(n, g):
    assert default_kv_heads(n) == g
    assert GroupedQueryConfig(d_model=8 * n, n_heads=n).n_kv_heads == g


def test_explicit_group_count_still_wins():
    assert GroupedQueryConfig(d_model=64, n_heads=8, n_kv_heads=4).n_kv_heads == 4


def gqa_sublayer(m, n, d, g):
    return m * n * d + 2 * m * g * d + n * d * m  # Q, K and V of g heads, output


def test_model_params_and_memory_agree(capsys):
    model = build_model("tiny-decoder", attention="gqa", d_model=32, n_heads=8, n_layers=2, d_ff=64, vocab_size=99)
    from mhe.attention.multi_head import GroupedQueryAttention

    gqa = [mod for mod in model.modules() if isinstance(mod, GroupedQueryAttention)]
    assert len(gqa) == 2 and all(mod.cfg.n_kv_heads == 2 for mod in gqa)
    want = 2 * gqa_sublayer(32, 8, 4, 2)
    assert count_attention_params(model) == want
    assert model_attention_params("gqa", arch="decoder", n_layers=2, d_model=32, n_heads=8) == want
    assert main(["params", "--arch", "decoder", "--layers", "2", "--heads", "8", "--head-dim", "4",
                 "--kinds", "gqa", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"gqa": want}
    assert main(["memory", "--heads", "8", "--head-dim", "4", "--kinds", "gqa", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["params"] == want // 2


def test_bert_base_gqa_uses_three_groups(capsys):
    assert main(["params", "--preset", "bert-base", "--kinds", "gqa", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"gqa": 12 * gqa_sublayer(768, 12, 64, 3)}
