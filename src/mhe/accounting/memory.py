"""Appendix C's memory model for one attention block (after Smith et al. 2022, section 2.1.1).

Mixed-precision (fp16) training with Adam, per attention block:
weights = P*(2+4) bytes, gradients = P*(2+4), Adam states = P*(4+4),
activations = batch * seq_len * hidden * 2; the saving ratio is relative to MHA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mhe.accounting.params import attention_params
from mhe.errors import require_positive


@dataclass(frozen=True)
class MemoryRow:
    kind: str
    params: int
    weights: int
    gradients: int
    adam_states: int
    activations: int
    total: int
    saving_ratio: float  # percent, relative to MHA

    def as_dict(self) -> dict:
        return asdict(self)


def attention_memory(kinds, *, d_model: int, n_heads: int, head_dim: int | None = None,
                     batch: int = 32, seq_len: int = 512, include_output: bool = True,
                     bias: bool = False) -> list[MemoryRow]:
    """Appendix C's table (bytes per attention block) for each kind; BERT-base with
    batch 32 and sequence length 512 reproduces the paper's Table 8 exactly."""
    require_positive(batch=batch, seq_len=seq_len)
    activations = batch * seq_len * d_model * 2

    def row(kind: str, ref_total: int | None) -> MemoryRow:
        p = attention_params(kind, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                             include_output=include_output, bias=bias)
        total = p * 6 + p * 6 + p * 8 + activations
        ratio = 0.0 if ref_total is None else 100.0 * (1 - total / ref_total)
        return MemoryRow(kind, p, p * 6, p * 6, p * 8, activations, total, ratio)

    mha_total = row("mha", None).total
    return [row(k, mha_total) for k in kinds]
