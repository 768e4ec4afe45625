"""Attention-only blocks (``model.mlp="none"``, Zoology's recall models): no feed-forward
sublayer and no norm before it, the same function as a block whose feed-forward outputs zero,
counted by ``decoder_params``, refused by the exports."""

import pytest
import torch

from mhe.accounting.params import decoder_params
from mhe.errors import MheError
from mhe.hf.export import save_model
from mhe.models import build_model, preset


@pytest.mark.parametrize("name", ["tiny-decoder", "llama-tiny"])
def test_attention_only_equals_a_zero_feed_forward(name):
    torch.manual_seed(0)
    cfg = preset(name).replace(dropout=0.0, attn_dropout=0.0)
    plain = build_model(cfg, vocab_size=50).eval()
    for layer in plain.decoder.layers:  # a feed-forward that outputs zero adds nothing
        for p in layer.ffn.out_layer.parameters():
            torch.nn.init.zeros_(p)
    none = build_model(cfg.replace(mlp="none"), vocab_size=50).eval()
    kept = {k: v for k, v in plain.state_dict().items() if ".ffn" not in k}
    assert set(kept) == set(none.state_dict())  # no ffn or ffn_norm weights
    none.load_state_dict(kept)
    x = torch.randint(0, 50, (2, 12))
    torch.testing.assert_close(none(x).logits, plain(x).logits, rtol=0, atol=1e-6)
    held = sum(p.numel() for p in {id(p): p for p in none.parameters()}.values())
    assert decoder_params(none.cfg)["total"] == held and decoder_params(none.cfg)["feed_forward"] == 0


def test_exports_refuse_attention_only_models(tmp_path):
    model = build_model(preset("tiny-decoder").replace(mlp="none"), vocab_size=50)
    for fmt in ("remote-code", "standard"):
        with pytest.raises(MheError, match="model.mlp='none'"):
            save_model(model, tmp_path / fmt, format=fmt)
        assert not (tmp_path / fmt).exists()
    assert not list(tmp_path.iterdir())  # no temporary sibling left
