"""``model.generate`` at batch 1 as a user's first and second calls see it, with the one-row
default compile options (coordinate-descent tuning) against inductor's defaults.

    python benchmarks/generate_first_call.py KINDS        # e.g. mhe-mul or mha,mhe-mul; needs CUDA

For each kind: llama-135m with random weights in bf16, a session of 4,352 positions, a 3,840-token
prompt and 256 new tokens, greedy; a default session (``compile_options`` None: the one-row
default, :data:`mhe.models.captured_step.ONE_ROW_COMPILE_OPTIONS`) and one given
``compile_options={}`` (inductor's defaults), each called twice. Prints the first call's seconds
(compilation and CUDA-graph capture included) and the second call's milliseconds, whole and per
new token (the prefill included). Results: docs/benchmarks.md section 12.
"""
import os
import sys
import time
from pathlib import Path

import torch

if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=OTHER/src runs another tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mhe.bench.common import bench_config  # noqa: E402
from mhe.models import build_model  # noqa: E402

print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)

for kind in sys.argv[1].split(","):
    torch.manual_seed(0)
    model = build_model(bench_config("llama-135m", kind, small=False, gqa_heads=4, max_len=4352, dropout=0.0,
                                     attn_dropout=0.0)).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (1, 3840), device="cuda")
    for label, opts in (("one-row default", None), ("inductor default", {})):
        session = model.generator(1, 4352, compile_options=opts)
        times = []
        for _ in range(2):
            torch.cuda.synchronize(); t = time.perf_counter()
            model.generate(ids, 256, session=session)
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
        print(f"{kind} {label} {session.compile_options}: first call {times[0]:.1f} s, second {times[1]*1e3:.1f} ms "
              f"({times[1]*1e3/256:.3f} ms a token incl. prefill)", flush=True)
