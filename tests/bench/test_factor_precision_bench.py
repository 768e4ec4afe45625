"""``benchmarks/train_bench.py factor-precision`` (``benchmarks/train/factor_precision.py``): its one-term form really rounds MHE-Mul's factors to bf16
under autocast, where the library's two-term product keeps their float32 values."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from train import factor_precision  # noqa: E402


def test_one_term_rounds_the_factors_and_two_terms_keep_them():
    """Under bf16 autocast the library's product is ``a * f`` with float32 factors, rounded once
    (to within a tie); the one-term form is ``a * bf16(f)``; with factors 1 + O(1e-2) (bf16's step
    at one is 2^-7) the two differ in a fifth of the elements."""
    from mhe.attention.mhe import _scaled_heads

    torch.manual_seed(0)
    bf = torch.bfloat16
    a = torch.randn(4, 50, 1, 16)
    f = 1 + 1e-2 * torch.randn(4, 16)
    with torch.autocast("cpu", dtype=bf):
        two, one = _scaled_heads(a, f), factor_precision.one_term_scaled_heads()(a, f)
    keeps = (a.to(bf).double() * f.double()).to(bf)  # [B, T, n, d]: one rounding of the float32 factors' product
    rounds = (a.to(bf).double() * f.to(bf).double()).to(bf)
    assert (two == keeps).float().mean() > 0.995 and (one == rounds).float().mean() > 0.995
    assert (one != two).float().mean() > 0.1


def test_the_table_reads_both_runs(tmp_path):
    for form, base in (("two-term", 5.0), ("one-term", 5.1)):
        run = tmp_path / form
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": {base - s / 10}}}\n' for s in (10, 20)))
        (run / "results.json").write_text('{"perplexity": 42.0, "status": "finished"}')
    text = factor_precision.table(factor_precision.curves(tmp_path))
    assert "| 10 | 4.0000 | 4.1000 | +0.1000 |" in text and "largest |gap| over 2 logged steps: 0.1000" in text
