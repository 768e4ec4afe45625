"""One spec per attention kind (``mhe.attention.spec``): the table agrees with the sublayers it
builds, and a model configuration holds the kind's spec while it serialises as its name."""

from __future__ import annotations

import json

import pytest

from mhe.accounting.params import count_params
from mhe.attention import KINDS, SPECS, attention_spec, build_attention
from mhe.attention.spec import specs_of
from mhe.errors import MheError
from mhe.models import preset


@pytest.mark.parametrize("kind", KINDS)
def test_each_spec_builds_its_sublayer_and_counts_its_parameters(kind):
    spec = SPECS[kind]
    causal = spec.causal
    mod = build_attention(spec, d_model=32, n_heads=8, causal=causal, bias=True,
                          **({"n_kv_heads": 2} if spec.grouped else {}))
    assert type(mod) is spec.layer_class and mod.kind == kind and mod.spec is spec
    assert type(mod.cfg.options) is spec.options
    assert spec in specs_of(type(mod))  # the class builds the kinds whose specs name it
    assert spec.params(mod.cfg) == count_params(mod)
    assert mod.cache_heads == spec.cache_heads(8, mod.cfg.options)
    assert mod.supports_cache is spec.has_cache


def test_what_the_specs_say_of_each_kind():
    says = {k: (s.is_mhe, s.grouped, s.head_groups, s.single_head, s.mixes, s.causal, s.folds_to)
            for k, s in SPECS.items()}
    assert says == {
        "mha": (False, False, True, False, False, True, None), "sha": (False, False, False, True, False, True, None),
        "mqa": (False, False, True, False, False, True, None), "gqa": (False, True, True, False, False, True, None),
        "skv": (False, False, False, False, False, True, None),
        "el-att": (False, False, False, False, False, True, None),
        "mhe-add": (True, False, False, False, False, True, "mqa"),
        "mhe-mul": (True, False, False, False, False, True, "mqa"),
        "fnet": (False, False, False, False, True, False, None), "linear": (False, False, False, False, True, True, None)}
    assert [s.display for s in SPECS.values()] == ["MHA", "SHA", "MQA", "GQA", "SKV", "EL-att", "MHE-Add", "MHE-Mul",
                                                  "FNet", "Linear"]
    mul = SPECS["mhe-mul"]
    # n heads cached where MHE computes them one by one; one shared head otherwise
    assert [mul.cache_heads(8, mul.options(**o), rotary=r) for o, r in
            (({}, False), ({}, True), ({"rope_order": "psi-then-rope"}, False), ({"rope_order": "psi-then-rope"}, True),
             ({"impl": "reference"}, False))] == [1, 1, 1, 8, 8]
    assert mul.row_name(mul.options(rope_order="psi-then-rope"), rotary=True) == "mhe-mul psi-then-rope"
    assert mul.row_name(mul.options(), rotary=False) == "mhe-mul"
    assert SPECS["gqa"].row_name(SPECS["gqa"].options(), rotary=True) == "gqa"
    with pytest.raises(MheError, match="unknown attention kind 'mhe'"):
        attention_spec("mhe")


def test_a_folded_sublayer_is_its_specs_fold_target():
    from mhe.attention.folding import fold_mhe

    for kind in ("mhe-add", "mhe-mul"):
        folded = fold_mhe(build_attention(kind, d_model=32, n_heads=4, causal=True).eval())
        assert folded.spec is attention_spec(SPECS[kind].folds_to) and folded.cache_heads == 1


def test_a_copied_or_pickled_sublayer_keeps_the_registrys_spec():
    import copy
    import pickle

    mod = build_attention("mhe-mul", d_model=32, n_heads=4)
    assert copy.deepcopy(mod).spec is SPECS["mhe-mul"] and pickle.loads(pickle.dumps(mod)).spec is SPECS["mhe-mul"]


def test_the_model_config_holds_the_spec_and_serialises_the_name():
    by_name = preset("gpt2-base").replace(attention="gqa", attn_options={"n_kv_heads": 4})
    by_spec = preset("gpt2-base").replace(attention=SPECS["gqa"], attn_options={"n_kv_heads": 4})
    assert by_spec.spec is by_name.spec is SPECS["gqa"]
    assert by_spec.attention == "gqa" and by_spec.to_dict() == by_name.to_dict()
    assert json.loads(json.dumps(by_spec.to_dict()))["attention"] == "gqa"
