"""One GQA default group count (n/4, attention.multi_head.default_kv_heads) for models,
`mhe params` and `mhe memory`; MHA, MQA and GQA are one class whose kind fixes or defaults g."""

import json

import pytest

from mhe.accounting import count_attention_params, model_attention_params
from mhe.attention import build_attention
from mhe.attention.multi_head import GroupedQueryAttention, default_kv_heads
from mhe.cli import main
from mhe.models import build_model


@pytest.mark.parametrize("n,g", [(1, 1), (4, 1), (6, 1), (8, 2), (12, 3), (16, 4), (32, 8), (20, 5)])
def test_default_kv_heads(n, g):
    assert default_kv_heads(n) == g
    assert build_attention("gqa", d_model=8 * n, n_heads=n).n_kv_heads == g


def test_explicit_group_count_still_wins():
    assert build_attention("gqa", d_model=64, n_heads=8, n_kv_heads=4).n_kv_heads == 4


def gqa_sublayer(m, n, d, g):
    return m * n * d + 2 * m * g * d + n * d * m  # Q, K and V of g heads, output


def test_model_params_and_memory_agree(capsys):
    model = build_model("tiny-decoder", attention="gqa", d_model=32, n_heads=8, n_layers=2, d_ff=64, vocab_size=99)
    gqa = [mod for mod in model.modules() if isinstance(mod, GroupedQueryAttention)]
    assert len(gqa) == 2 and all(mod.kind == "gqa" and mod.n_kv_heads == 2 for mod in gqa)
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


def test_one_explicit_table_and_one_class_for_mha_mqa_gqa():
    from mhe.attention import KINDS, PAPER_KINDS, SPECS, attention_class

    assert KINDS == ("mha", "sha", "mqa", "gqa", "skv", "el-att", "mhe-add", "mhe-mul", "fnet", "linear")
    assert PAPER_KINDS == ("sha", "mha", "el-att", "mqa", "skv", "mhe-add", "mhe-mul")
    assert {attention_class(k) for k in ("mha", "mqa", "gqa")} == {GroupedQueryAttention}
    for kind, spec in SPECS.items():
        built = build_attention(kind, d_model=32, n_heads=4)
        assert built.kind == kind and built.spec is spec and type(built) is spec.layer_class
    g = {k: build_attention(k, d_model=32, n_heads=8).cache_heads for k in ("mha", "mqa", "gqa")}
    assert g == {"mha": 8, "mqa": 1, "gqa": 2}


def test_a_class_refuses_a_kind_or_options_it_does_not_build():
    from mhe.attention import AttentionConfig, MHEOptions
    from mhe.attention.single_head import SingleHeadAttention
    from mhe.errors import MheError

    cfg = AttentionConfig(d_model=32, n_heads=4)
    assert GroupedQueryAttention(cfg).kind == "mha"  # the first kind it builds: the default options fit it
    with pytest.raises(MheError, match="attention kind 'gqa' takes GroupedQueryOptions, got NoOptions"):
        GroupedQueryAttention(cfg, kind="gqa")
    with pytest.raises(MheError, match="unknown kind for SingleHeadAttention 'mha'"):
        SingleHeadAttention(cfg, kind="mha")
    with pytest.raises(MheError, match="options must be an attention kind's options dataclass"):
        AttentionConfig(d_model=32, n_heads=4, options=MHEOptions)
