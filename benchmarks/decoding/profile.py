"""Kernels per generated token, per kind and step mode: what one more token of ``model.generate``
launches (the difference of a 20-token and a 4-token call, so the prefill cancels).

    python benchmarks/decode.py profile [--kinds mha,mhe-mul] [--modes eager,graph,compile]
                                        [--batch 1] [--context 512] [--prompt N] [--top N] [--prefill]
                                        [--json out.json]

On a GPU (gpt2-base, bf16) it counts device kernels with the profiler, replays of the captured
region included, and the GPU-busy microseconds per token, whose gap to the milliseconds per token
is launch and host time; with ``PYTHONPATH=OLD/src`` and ``--modes default`` it counts an older
tree's. On a CPU (``--smoke``: tiny sizes) it counts leaf aten operators instead, which stand in
for kernels in eager mode (``aot_eager`` stands in for compile). ``decode.py speed`` runs the
same count for its batch-1 rows. ``--top N`` lists the N kernels with the most device time per
token (launches and microseconds): where a compiled step's time goes (issue 41's profile).
``--prefill`` profiles one call for one new token instead (the prompt's kernels, after a warm-up):
where a prefill's time goes, e.g. one kind's against another's, or against an older tree's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from decoding import rows as decode_rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py profile", description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default="mha,mhe-mul")
    ap.add_argument("--modes", default="eager,graph,compile", help="step modes ('default': the call without one)")
    ap.add_argument("--preset", default="gpt2-base")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=0, help="prompt tokens (default: half the context)")
    ap.add_argument("--top", type=int, default=0, help="also list the N kernels with the most device time per token")
    ap.add_argument("--prefill", action="store_true", help="profile the prefill (one call for one token) instead")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    context = 48 if a.smoke else a.context
    rows = []
    for kind in a.kinds.split(","):
        model = decode_rows.build(a.preset, kind, context, dev, dtype, a.smoke)
        ids, mask = decode_rows.prompts(model, a.batch, min(a.prompt, context - 24) if a.prompt else context // 2, dev)
        for mode in a.modes.split(","):
            options = {} if mode == "default" else {"step_mode": mode}
            if mode == "compile" and dev.type == "cpu":
                options["compile_options"] = {"backend": "aot_eager"}
            if a.prefill:
                count = decode_rows.kernels_of_prefill(model, ids, mask, dev, top=a.top, **options)
                print(f"{kind:8s} {mode:8s} prefill of {ids.shape[1]} tokens: {count['kernels']} {count['counted']}, "
                      f"{count['busy_us']:9.1f} us busy", flush=True)
            else:
                count = decode_rows.kernels_per_token(model, ids, mask, dev, top=a.top, **options)
                print(f"{kind:8s} {mode:8s} {count['kernels_per_token']:7.1f} {count['counted']} per token, "
                      f"{count['busy_us_per_token']:8.1f} us busy", flush=True)
            rows.append({"kind": kind, "mode": mode, "prefill": a.prefill, **count})
            for k in count.get("top_kernels", []):
                print(f"    {k['us']:8.1f} us {k['launches']:5.1f} x  {k['name']}", flush=True)
        del model
        decode_rows.release(dev)
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"device: {card}; torch {torch.__version__}; batch {a.batch}, context {context}")
    if a.json:
        Path(a.json).write_text(json.dumps({"device": card, "rows": rows}, indent=1))

