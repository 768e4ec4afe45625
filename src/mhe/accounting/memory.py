"""Appendix C's memory model for one attention block (after Smith et al. 2022, section 2.1.1).

Mixed-precision (fp16) training with Adam, per attention block:
weights = P*(2+4) bytes, gradients = P*(2+4), Adam states = P*(4+4),
activations = batch * seq_len * hidden * 2; the saving ratio is relative to MHA.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from typing import TYPE_CHECKING

from mhe.accounting.params import attention_params, decoder_params
from mhe.attention.spec import SPECS, AttentionSpec, attention_spec
from mhe.errors import require_positive

if TYPE_CHECKING:
    from torch import nn


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

    def as_json(self) -> dict:
        """The row with every byte count under a ``_bytes`` key (exact integers, the paper's
        Table 8 figures) and the saving in percent under ``saving_percent``."""
        d = self.as_dict()
        out = {"kind": d.pop("kind"), "params": d.pop("params"), "saving_percent": d.pop("saving_ratio")}
        return {**out, **{f"{k}_bytes": v for k, v in d.items()}}


BYTE_FIELDS = ("weights", "gradients", "adam_states", "activations", "total")


def byte_unit(largest: float) -> tuple[str, int]:
    """The binary unit a column whose largest entry is ``largest`` bytes is printed in:
    ``("KiB", 2**10)`` below one MiB, ``("MiB", 2**20)`` below one GiB, else ``("GiB", 2**30)``."""
    if largest >= 2 ** 30:
        return "GiB", 2 ** 30
    return ("MiB", 2 ** 20) if largest >= 2 ** 20 else ("KiB", 2 ** 10)


def memory_table(rows: list[MemoryRow]) -> tuple[list[str], list[list[str]]]:
    """Header and cells of ``mhe memory``'s table: byte counts in KiB, MiB or GiB (chosen by the
    largest total), the unit in each column's header, two decimals."""
    unit, scale = byte_unit(max((r.total for r in rows), default=0))
    head = ["kind"] + [f"{name} ({unit})" for name in ("weights", "gradients", "Adam states", "activations",
                                                      "total")] + ["saving vs MHA (%)"]
    cells = [[r.kind] + [f"{getattr(r, f) / scale:,.2f}" for f in BYTE_FIELDS] + [f"{r.saving_ratio:.2f}"]
             for r in rows]
    return head, cells


def attention_memory(kinds, *, d_model: int, n_heads: int, head_dim: int | None = None,
                     batch: int = 32, seq_len: int = 512, include_output: bool = True,
                     bias: bool = False, options: dict[str, dict] | None = None) -> list[MemoryRow]:
    """Appendix C's table (bytes per attention block) for each kind; BERT-base with
    batch 32 and sequence length 512 reproduces the paper's Table 8 exactly. ``options``
    maps a kind's name to its own options (e.g. ``{"gqa": {"n_kv_heads": 3}}``); ``kinds``: specs,
    or names (each looked up once here)."""
    require_positive(batch=batch, seq_len=seq_len)
    activations = batch * seq_len * d_model * 2

    def row(spec: AttentionSpec, ref_total: int | None) -> MemoryRow:
        p = attention_params(spec, d_model=d_model, n_heads=n_heads, head_dim=head_dim,
                             include_output=include_output, bias=bias, **(options or {}).get(spec.name, {}))
        total = p * 6 + p * 6 + p * 8 + activations
        ratio = 0.0 if ref_total is None else 100.0 * (1 - total / ref_total)
        return MemoryRow(spec.name, p, p * 6, p * 6, p * 8, activations, total, ratio)

    mha_total = row(SPECS["mha"], None).total
    return [row(attention_spec(k), mha_total) for k in kinds]


TRAINING_BYTES_PER_PARAM = 6 + 6 + 8
"""Appendix C: fp16 and fp32 weights, fp16 and fp32 gradients, Adam's two fp32 moments."""


def decoder_memory(cfg, *, cache_bytes: int = 2) -> dict[str, int]:
    """A decoder language model's whole-model figures: ``params`` (every parameter,
    :func:`~mhe.accounting.params.decoder_params`), ``training_state_bytes`` (params x 20,
    Appendix C's accounting for mixed precision with Adam; activations excluded) and
    ``kv_cache_bytes_per_token`` (what one sequence's KV cache holds per position:
    2 (K and V) x layers x cached K/V heads x d x ``cache_bytes``; 2 = bf16). The cached heads
    are the sublayer's own (``cache_heads``: n for MHA and SKV, g for GQA, one for MQA, SHA and
    fast MHE, n for MHE with psi before RoPE: :meth:`mhe.attention.spec.AttentionSpec.cache_heads`, tested
    against the built sublayers); no torch is needed."""
    params = decoder_params(cfg)["total"]
    # MHE's cache depends on where the rotation sits (rope_order)
    heads = cfg.spec.cache_heads(cfg.n_heads, cfg.attn_options, rotary=cfg.rotary)
    return {"params": params, "training_state_bytes": params * TRAINING_BYTES_PER_PARAM, "kv_heads": heads,
            "kv_cache_bytes_per_token": 2 * cfg.n_layers * heads * cfg.resolved_head_dim * cache_bytes}


def kv_cache_bytes_per_token(model: nn.Module, *, bytes_per_value: int = 2) -> int:
    """Bytes a model's KV cache holds per cached token: for every attention sublayer that
    caches, its keys and values (2 x its cache heads x head size; one head for MQA and fast
    MHE, g for GQA, n for MHA) at ``bytes_per_value`` each (2: bf16/fp16). Cross-attention
    counts once per source token; FNet/Linear sublayers hold no cache."""
    from mhe.attention.base import Attention

    return sum(2 * mod.cache_heads * mod.cfg.head_dim * bytes_per_value
               for mod in model.modules() if isinstance(mod, Attention) and mod.supports_cache)
