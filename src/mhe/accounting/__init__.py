"""Parameter and memory accounting (paper Tables 1-4, Appendix C and D, section 5.4)."""

from mhe.accounting.memory import MemoryRow, attention_memory, kv_cache_bytes_per_token
from mhe.accounting.params import (
    ARCHS,
    attention_params,
    attention_sublayers,
    count_attention_params,
    count_params,
    gpt3_projection,
    model_attention_params,
    model_param_counts,
)

__all__ = ["ARCHS", "MemoryRow", "attention_memory", "attention_params", "attention_sublayers",
           "count_attention_params", "count_params", "gpt3_projection", "kv_cache_bytes_per_token",
           "model_attention_params", "model_param_counts"]
