"""Section 4.6's efficiency metrics: PRR (against MHA) and PEoP (against SHA)."""

from __future__ import annotations

from mhe.errors import MheError


def prr(score: float, mha_score: float, *, higher_is_better: bool = True) -> float:
    """Performance retention ratio, as a fraction (multiply by 100 for the tables).

    Direct indicators: score / score_MHA. Inverse indicators (perplexity):
    1 - (score - score_MHA) / score_MHA.
    """
    if mha_score == 0:
        raise MheError("PRR needs a non-zero MHA score")
    if higher_is_better:
        return score / mha_score
    return 1.0 - (score - mha_score) / mha_score


def peop(score: float, params: int, sha_score: float, sha_params: int, *,
         higher_is_better: bool = True) -> float:
    """Performance elasticity of parameters against SHA.

    ((score/score_SHA) - 1) / ((params/params_SHA) - 1), negated for inverse
    indicators. Undefined for SHA itself (and any model with SHA's size).
    """
    if sha_score == 0 or sha_params == 0:
        raise MheError("PEoP needs a non-zero SHA score and SHA parameter count")
    dp = params / sha_params - 1.0
    if dp == 0:
        raise MheError(f"PEoP is undefined for a model with SHA's parameter count ({params})")
    e = (score / sha_score - 1.0) / dp
    return e if higher_is_better else -e
