"""``benchmarks/decode.py profile``'s counts (``decoding/rows.py``) at smoke sizes on a CPU (leaf aten operators stand in for
kernels): a prefill-only profile counts one call's prompt, not its warm-up too, and with the
per-token count it adds up to a longer call's operators."""

import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import profile

BENCH = Path(__file__).parent.parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
from decoding import rows as decode_rows  # noqa: E402


def leaf_ops(model, ids, mask, new: int) -> int:
    with profile() as prof:
        model.generate(ids, new, attention_mask=mask, step_mode="eager")
    return decode_rows._count(prof, torch.device("cpu"))[0]


@pytest.mark.parametrize("kind", ["mqa", "mhe-mul"])
def test_the_prefill_and_the_tokens_add_up_to_a_longer_call(kind):
    dev = torch.device("cpu")
    model = decode_rows.build("gpt2-base", kind, 48, dev, torch.float32, True)
    ids, mask = decode_rows.prompts(model, 1, 24, dev)
    prefill = decode_rows.kernels_of_prefill(model, ids, mask, dev, step_mode="eager")
    per_token = decode_rows.kernels_per_token(model, ids, mask, dev, step_mode="eager")["kernels_per_token"]
    assert prefill["kernels"] == leaf_ops(model, ids, mask, 1) > 0
    assert per_token > 0 and per_token == int(per_token)
    assert leaf_ops(model, ids, mask, 5) == prefill["kernels"] + 4 * per_token
