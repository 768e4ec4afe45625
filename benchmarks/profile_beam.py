"""Where one beam step's GPU time goes (transformer-base, 64 sources x beam 4, max_len 100).

Runs the static beam step eagerly (steps 6-15, the first 16-position window) under the profiler and prints the kernels with the most
GPU time, for fp32 (what ``mhe translate`` runs) and bf16.
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from mhe.models import build_model
from mhe.models.beam_search import BeamSearcher


def main() -> None:
    dev = torch.device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = build_model("transformer-base", attention="mha", vocab_size=8000, dropout=0.0,
                            attn_dropout=0.0).to(dev, dtype).eval()
        src = torch.randint(4, 8000, (64, 20), device=dev)
        mask = torch.ones_like(src, dtype=torch.bool)
        with torch.no_grad():
            s = BeamSearcher(model, step_mode="eager").session(b=64, beam=4, src_len=24, max_len=100, eos_id=2)
            s.start(model.encode(src, mask).repeat_interleave(4, 0), mask.repeat_interleave(4, 0), 1)
            for t in range(5):
                s.advance(t)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for t in range(5, 15):  # target positions 6-15: a 16-position self-attention window
                    s.advance(t)
                torch.cuda.synchronize()
        events = prof.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 10 / 1000
        print(f"\n{dtype}: GPU busy {busy:.3f} ms per beam step")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
            print(f"  {e.self_device_time_total / 10 / 1000:7.3f} ms  x{e.count // 10:<4} {e.key[:100]}")


if __name__ == "__main__":
    main()
