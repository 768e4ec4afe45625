"""Rotary positions, RMSNorm and SwiGLU against their literal float64 references."""

import pytest
import torch

from mhe.attention.rotary import RotaryEmbedding, rotary_width
from mhe.errors import MheError
from mhe.models.config import ModelConfig
from mhe.models.layers import RMSNorm, SwiGLU
from reference import rms_norm_reference, rope_reference, swiglu_reference

B, T, H, D = 2, 7, 3, 16


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25])
@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_rotary_equals_reference_per_pair(fraction, base):
    rot = RotaryEmbedding(D, base=base, fraction=fraction, max_len=64)
    x = torch.randn(B, H, T, D, dtype=torch.float64)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [3, 9, 17, 30, 41, 50, 63]])  # [B, T], a gap, the last position
    got = rot(x, pos)
    for h in range(H):
        want = rope_reference(x[:, h], pos, base=base, fraction=fraction)
        torch.testing.assert_close(got[:, h], want, rtol=0, atol=1e-15)
    r = rotary_width(D, fraction)
    assert torch.equal(got[..., r:], x[..., r:])  # the unrotated part passes through
    assert not torch.allclose(got[..., :r], x[..., :r])


def test_rotary_positions_shared_by_the_batch_and_dtypes():
    rot = RotaryEmbedding(D, max_len=32)
    x = torch.randn(B, H, T, D, dtype=torch.float64)
    pos = torch.arange(3, 3 + T)
    torch.testing.assert_close(rot(x, pos), rot(x, pos.expand(B, -1)), rtol=0, atol=0)
    # float32: the same float32 constants, the rotation in float32
    got32 = rot(x.float(), pos)
    torch.testing.assert_close(got32, rot(x, pos).float(), rtol=1e-6, atol=1e-6)
    # position 0 is the identity; a rotation keeps each pair's length (to float32 cos/sin)
    torch.testing.assert_close(rot(x, torch.zeros(T, dtype=torch.long)), x, rtol=0, atol=0)
    half = D // 2
    pair = lambda t: t[..., :half] ** 2 + t[..., half:] ** 2  # noqa: E731
    torch.testing.assert_close(pair(rot(x, pos)), pair(x), rtol=1e-6, atol=1e-6)


def test_rotary_table_follows_the_module_and_survives_meta_construction():
    with torch.device("meta"):
        rot = RotaryEmbedding(D, max_len=16)  # as loaders that build on the meta device do
    x = torch.randn(1, 1, 4, D, dtype=torch.float64)
    pos = torch.arange(4)
    want = rope_reference(x[:, 0], pos[None], base=10000.0)
    torch.testing.assert_close(rot(x, pos)[:, 0], want, rtol=0, atol=1e-15)
    rot.double()  # a dtype change keeps the float32 constants
    torch.testing.assert_close(rot(x, pos)[:, 0], want, rtol=0, atol=1e-15)
    assert rot.table(torch.device("cpu"))[0].dtype == torch.float32


def test_relative_positions_only():
    """Scores depend on the positions only through their difference (to float32 angles)."""
    rot = RotaryEmbedding(D, max_len=64)
    q, k = torch.randn(1, 1, 1, D, dtype=torch.float64), torch.randn(1, 1, 1, D, dtype=torch.float64)
    score = lambda i, j: float((rot(q, torch.tensor([i])) * rot(k, torch.tensor([j]))).sum())  # noqa: E731
    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)


@pytest.mark.parametrize("bad", [dict(fraction=0.1), dict(fraction=0.0), dict(fraction=1.5), dict(base=1.0)])
def test_rotary_bad_settings_are_one_line(bad):
    with pytest.raises(MheError) as e:
        RotaryEmbedding(D, max_len=8, **bad)
    assert "\n" not in str(e.value)


def test_rms_norm_equals_reference_and_llama_in_half_precision():
    x = torch.randn(B, T, 32, dtype=torch.float64) * 3
    norm = RMSNorm(32, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.normal_()
    torch.testing.assert_close(norm(x), rms_norm_reference(x, norm.weight, 1e-5), rtol=0, atol=1e-14)
    # bf16: the statistic in float32, the gain on the bf16 result (Llama's RMSNorm)
    xb, nb = x.bfloat16(), RMSNorm(32, eps=1e-5).bfloat16()
    with torch.no_grad():
        nb.weight.copy_(norm.weight)
    h = xb.float()
    want = nb.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()
    assert torch.equal(nb(xb), want)


def test_swiglu_equals_reference():
    cfg = ModelConfig(arch="decoder", vocab_size=99, d_model=32, n_layers=1, n_heads=4, d_ff=48, max_len=16,
                      mlp="swiglu", dropout=0.0)
    ffn = SwiGLU(cfg).double()
    assert all(lin.bias is None for lin in (ffn.gate, ffn.up, ffn.down))
    assert sum(p.numel() for p in ffn.parameters()) == 3 * 32 * 48
    x = torch.randn(B, T, 32, dtype=torch.float64)
    want = swiglu_reference(x, ffn.gate.weight, ffn.up.weight, ffn.down.weight)
    torch.testing.assert_close(ffn(x), want, rtol=0, atol=1e-14)
