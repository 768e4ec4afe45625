"""Inference-time folding: a trained MHE model decodes exactly like a multi-query model."""

import pytest
import torch

from mhe.attention import build_attention
from mhe.attention.folding import fold_mhe, fold_model
from mhe.models import build_model


@pytest.mark.parametrize("kind", ["mhe-add", "mhe-mul"])
@pytest.mark.parametrize("bias", [False, True])
def test_folded_sublayer_equals_mhe(kind, bias):
    mod = build_attention(kind, d_model=32, n_heads=4, bias=bias, causal=True).double()
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.4)
    mod.eval()
    folded = fold_mhe(mod)
    assert folded.kind == "mqa" and folded.new_cache(1, 4).k.shape[1] == 1
    x, ctx = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 5, 32, dtype=torch.float64)
    torch.testing.assert_close(folded(x), mod(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(folded(x, context=ctx), mod(x, context=ctx), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["mhe-add", "mhe-mul"])
def test_folded_model_generates_the_same_tokens(kind):
    model = build_model("tiny-decoder", attention=kind, vocab_size=99, d_model=32, n_heads=4, n_layers=2,
                        max_len=32).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)
    prompt = torch.randint(0, 99, (2, 4))
    want = model.generate(prompt, 10)
    logits = model(prompt).logits
    fold_model(model)
    assert {m.kind for m in model.modules() if getattr(m, "kind", "")} == {"mqa"}
    torch.testing.assert_close(model(prompt).logits, logits, rtol=1e-10, atol=1e-10)
    assert torch.equal(model.generate(prompt, 10), want)


def test_bench_smoke_runs_on_cpu(tmp_path, capsys):
    import json

    from mhe.cli import main

    assert main(["bench", "--smoke", "--kinds", "mha,mqa,mhe-mul", "--reps", "1", "--json", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "attention sublayer" in out and "training step" in out and "decode one token" in out
    data = json.loads((tmp_path / "b.json").read_text())
    kinds = [r["kind"] for r in data["attention"]]
    assert kinds[:3] == ["mha", "mqa", "mhe-mul"] and "mhe-mul (reference)" in kinds
    decode = {(r["kind"], r["batch"]): r for r in data["decode"]}
    # one K/V head instead of n: the cache is n times smaller
    assert decode[("mha", 2)]["kv_cache_mib_total"] == pytest.approx(4 * decode[("mhe-mul", 2)]["kv_cache_mib_total"])
