"""PRR and PEoP (section 4.6) against rows of Table 2 that reproduce from the printed numbers."""

import pytest

from mhe.errors import MheError
from mhe.metrics import peop, prr

SHA, MHE = 8_847_360, 8_875_008


def test_peop_perplexity_rows_of_table_2():
    assert round(peop(53.8, MHE, 62.0, SHA, higher_is_better=False), 2) == 42.32  # WikiText-103 MHE-Mul
    assert round(peop(50.7, MHE, 68.1, SHA, higher_is_better=False), 2) == 81.76  # Penn Treebank MHE-Mul
    assert round(peop(54.0, MHE, 62.0, SHA, higher_is_better=False), 2) == 41.29  # WikiText-103 MHE-Add
    assert round(peop(43.0, 28_311_552, 62.0, SHA, higher_is_better=False), 2) == 0.14  # MHA


def test_prr_both_directions():
    assert round(100 * prr(50.7, 44.3, higher_is_better=False), 1) == 85.6  # Table 2, PTB MHE-Mul
    assert round(100 * prr(53.8, 43.0, higher_is_better=False), 1) == 74.9  # WikiText-103 MHE-Mul
    assert round(100 * prr(62.0, 43.0, higher_is_better=False), 1) == 55.8  # SHA
    assert round(100 * prr(80.6, 81.9), 1) == 98.4  # Table 9, GLUE base
    assert prr(10.0, 10.0) == 1.0 == prr(10.0, 10.0, higher_is_better=False)


def test_peop_direct_indicator_sign():
    assert peop(80.0, 2 * SHA, 79.0, SHA) == pytest.approx((80 / 79 - 1) / 1.0)
    assert peop(78.0, 2 * SHA, 79.0, SHA) < 0


def test_undefined_cases_are_named():
    with pytest.raises(MheError, match="undefined for a model with SHA's parameter count"):
        peop(1.0, SHA, 2.0, SHA)
    with pytest.raises(MheError, match="non-zero MHA score"):
        prr(1.0, 0.0)
