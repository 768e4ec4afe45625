"""One batch-1 prefill of ``model.generate`` per kind and decode kernel, in the tree on PYTHONPATH:
how long it takes, what SDPA is handed, and where its host and GPU time go (issue 40's MQA prefill).

    PYTHONPATH=SRC python benchmarks/prefill_check.py [--kinds mqa,mhe-mul,mha] [--prompt 256] [--smoke]

For each kind (gpt2-base, bf16, random weights, context 512): the median of 7 calls for one new
token (after two warm-up calls) with the default decode kernel, with ``kernel="sdpa"`` and with
``kernel="sdpa-expand"``; the shapes, strides, mask and flags of the first two SDPA calls; then
the profiler's operators of one default call by host time and by device time. Run it once with
``SRC`` = src and once with an older tree's src to compare the trees. The profiled call may
build a new default session (the calls with other kernels can displace it), so its host table can
include the inference view's construction. ``--smoke``: tiny sizes on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import decode_rows  # noqa: E402


def recorded_sdpa_calls(fn, limit: int = 2) -> list[dict]:
    """What the first ``limit`` SDPA calls of ``fn()`` are handed."""
    seen, sdpa = [], F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if len(seen) < limit:
            mask = None if attn_mask is None else (attn_mask.dtype, tuple(attn_mask.shape), attn_mask.stride())
            seen.append({"q": (tuple(q.shape), q.stride()), "k": (tuple(k.shape), k.stride()), "mask": mask,
                         "causal": is_causal, "gqa": enable_gqa})
        return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                    enable_gqa=enable_gqa)
    F.scaled_dot_product_attention = record
    try:
        fn()
    finally:
        F.scaled_dot_product_attention = sdpa
    return seen


def median_ms(fn, sync, n: int = 7) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="mqa,mhe-mul,mha")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    a = ap.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    prompt = 24 if a.smoke else a.prompt
    for kind in a.kinds.split(","):
        model = decode_rows.build("gpt2-base", kind, 2 * prompt, dev, dtype, a.smoke)
        ids, mask = decode_rows.prompts(model, 1, prompt, dev)
        for kernel in (None, "sdpa", "sdpa-expand"):
            options = {} if kernel is None else {"kernel": kernel}
            call = lambda: model.generate(ids, 1, attention_mask=mask, **options)  # noqa: E731
            ms = median_ms(call, sync)
            print(f"{kind:8s} kernel={kernel}: prefill call {ms:.2f} ms; first SDPA calls: {recorded_sdpa_calls(call)}",
                  flush=True)
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            model.generate(ids, 1, attention_mask=mask)
            sync()
        table = prof.key_averages()
        print(table.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=70))
        if cuda:
            print(table.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=90))


if __name__ == "__main__":
    main()
