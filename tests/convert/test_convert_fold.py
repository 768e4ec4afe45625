"""psi-then-rope, then fold (:mod:`mhe.convert.fold`): an MHE-Mul ``psi-then-rope`` model whose
query/key factors have the same within-pair ratios in every head folds exactly to ``rope-then-psi``
(one K/V head) although its factors are not equal within the pairs; with free factors (what a
fit under ``psi-then-rope`` finds) the fold is not exact and says by how much; MHE-Add and other
orders are refused in one line."""

import pytest
import torch

from conftest import N_HEADS
from mhe.convert import convert_model
from mhe.convert.fold import fold_rope_order, pair_factors
from mhe.errors import MheError
from test_convert_rotary import HALF, embeddings, gap, llama, logits

TOL = 1e-10


def foldable(mhe):
    """Factors (1 + e) = c * P_i: a common factor c differing within the pairs times per-head
    factors P_i equal within them."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for layer in mhe.decoder.layers:
            e = layer.self_attn.head_embed  # [3, n, d]
            d = e.shape[-1]
            c = 1 + 0.5 * torch.randn(2, 1, d, generator=g, dtype=e.dtype)
            p = 1 + 0.5 * torch.randn(2, N_HEADS, d, generator=g, dtype=e.dtype)
            p[:, :, HALF:2 * HALF] = p[:, :, :HALF]
            e[:2] = c * p - 1
            e[2] = 0.5 * torch.randn(N_HEADS, d, generator=g, dtype=e.dtype)
    return mhe


def test_factors_with_head_independent_pair_ratios_fold_exactly():
    mhe = foldable(llama("mhe-mul", qkv_bias=True, rope_order="psi-then-rope"))
    e = mhe.decoder.layers[0].self_attn.head_embed
    assert (e[:2, :, HALF:2 * HALF] - e[:2, :, :HALF]).abs().max() > 0.1  # not rope-then-psi as it stands
    folded, gaps = fold_rope_order(mhe)
    assert folded.cfg.attn_options.rope_order == "rope-then-psi"
    assert folded.decoder.layers[0].self_attn.cache_heads == 1
    assert all(g < TOL for _, g in gaps)
    assert gap(logits(folded), logits(mhe)) < TOL


def test_free_factors_do_not_fold_and_the_gap_says_so():
    mhe = embeddings(llama("mhe-mul", rope_order="psi-then-rope"), pairs=False)
    folded, gaps = fold_rope_order(mhe)
    assert min(g for _, g in gaps) > 1e-2 and gap(logits(folded), logits(mhe)) > 1e-3
    # a psi-then-rope fit of an MHA source has free factors too: its fold is not exact
    conv, _ = convert_model(llama("mha"), "mhe-mul", options={"rope_order": "psi-then-rope"})
    assert min(g for _, g in fold_rope_order(conv)[1]) > 1e-3


def test_pair_factors_is_the_literal_split():
    f = torch.tensor([[2.0, 3.0, 4.0, 6.0, 5.0], [1.0, 1.5, 2.0, 3.0, 7.0]], dtype=torch.float64)  # width 4
    c, p, g = pair_factors(f, 4)
    assert torch.allclose(c, torch.tensor([1.5, 2.25, 3.0, 4.5, 1.0], dtype=torch.float64))
    assert torch.allclose(c * p, f) and g < TOL  # ratios 1/2 and 3/4 in both heads
    assert torch.equal(p[:, 0], p[:, 2]) and torch.equal(p[:, 1], p[:, 3])


@pytest.mark.parametrize("kind,opts", [("mhe-add", {"rope_order": "psi-then-rope"}),
                                       ("mhe-mul", {"rope_order": "rope-then-psi"}), ("mha", {})])
def test_other_models_are_refused_in_one_line(kind, opts):
    with pytest.raises(MheError, match="folding takes an mhe-mul model with rotary positions") as e:
        fold_rope_order(llama(kind, **opts))
    assert "\n" not in str(e.value)
