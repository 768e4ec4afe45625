"""BLEU with sacrebleu on detokenised text (Post 2018), with its signature."""

from __future__ import annotations

from mhe.errors import MheError


def corpus_bleu(hypotheses: list[str], references: list[str], *, tokenize: str = "13a") -> dict:
    """``{"bleu", "signature", ...}`` for one reference per hypothesis."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise MheError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    metric = sacrebleu.metrics.BLEU(tokenize=tokenize)
    score = metric.corpus_score(hypotheses, [references])
    return {"bleu": score.score, "signature": str(metric.get_signature()), "bp": score.bp,
            "precisions": list(score.precisions), "sys_len": score.sys_len, "ref_len": score.ref_len}
