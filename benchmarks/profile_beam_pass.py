"""Where a whole beam-search pass goes, on a trained run exported by ``beam_speed.py --export``.

    python benchmarks/profile_beam_pass.py EXPORTED.pt

Decodes the exported test set at ``eval_batch`` 256, 512 and 1,000 (warm pass timed, output
checked against batch 256), then profiles one warm pass at 256: wall time, GPU kernel time, the
kernels with the most GPU time and the host calls with the most self time; last, a pass with
TF32 matrix products allowed (the graphs captured earlier keep their fp32 kernels).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import beam_speed  # noqa: E402  (the export format and model builder)

from mhe.tasks.translation import TranslationTask  # noqa: E402


def task_for(saved: dict, model, batch: int) -> TranslationTask:
    task = TranslationTask()
    task.tok = Tokenizer.from_str(saved["tokenizer"])
    task.o = dict(saved["options"], eval_batch=batch)
    task.bos, task.eos, task.pad = (saved["special"][k] for k in ("bos", "eos", "pad"))
    task.max_len = model.cfg.max_len
    return task


def main() -> None:
    saved = torch.load(sys.argv[1], weights_only=False)
    dev = torch.device("cuda")
    model = beam_speed.build_exported(saved, "").to(dev).eval()
    src = saved["sources"]
    first = None
    for batch in (256, 512, 1000):
        task = task_for(saved, model, batch)
        out = task.translate(model, src)  # cold pass: captures the steps
        sec = beam_speed.timed(lambda: task.translate(model, src), dev)
        first = first or out
        same = sum(a == b for a, b in zip(out, first))
        print(f"eval_batch {batch}: warm pass {sec:.3f} s; identical to batch 256: {same}")
    task = task_for(saved, model, 256)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        task.translate(model, src)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    print(f"profiled pass: wall {wall * 1e3:.0f} ms, GPU kernel time {gpu:.0f} ms")
    print("top GPU:")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:14]:
        print(f"  {e.self_device_time_total / 1e3:8.1f} ms  x{e.count:<6d} {e.key[:90]}")
    print("top CPU (self):")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:14]:
        print(f"  {e.self_cpu_time_total / 1e3:8.1f} ms  x{e.count:<6d} {e.key[:90]}")
    torch.backends.cuda.matmul.allow_tf32 = True
    out = task.translate(model, src)
    sec = beam_speed.timed(lambda: task.translate(model, src), dev)
    print(f"tf32 matmuls allowed, eval_batch 256: warm {sec:.3f} s; identical: "
          f"{sum(a == b for a, b in zip(out, first))}")


if __name__ == "__main__":
    main()
