"""Beam-search speed of the encoder-decoder on Multi30k-sized input, one source tree at a time.

Builds transformer-base (vocabulary 8000, random weights from seed 0 with the tied
embedding scaled by 8 so that the output distributions are not near-uniform, or ``--weights``),
decodes ``--sentences`` random sources of 8-30 tokens (Multi30k test 2016 has 1,000
sentences of about that many sub-words) in batches of 64 sorted by length, beam 4, alpha
0.6, max_len 100, and writes the hypotheses and the time. Run it once
with the current tree and once with an older tree on PYTHONPATH, then ``--compare`` the two.

    python benchmarks/beam_speed.py --out new.pt --save-weights w.pt
    PYTHONPATH=old/src python benchmarks/beam_speed.py --out old.pt --weights w.pt
    python benchmarks/beam_speed.py --compare new.pt old.pt
"""

from __future__ import annotations

import argparse
import inspect
import time

import torch


def sources(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 31, (n,), generator=g)
    return [torch.randint(4, vocab, (int(t),), generator=g).tolist() for t in lengths]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--weights", default="")
    ap.add_argument("--save-weights", default="")
    ap.add_argument("--sentences", type=int, default=1000)
    ap.add_argument("--step-mode", default="auto")
    ap.add_argument("--compare", nargs=2, default=None)
    ap.add_argument("--kernel", default="", help="attention kernel (ModelConfig.attn_kernel; newer trees only)")
    ap.add_argument("--dtype", default="float32", help="float32 (as mhe translate) or bfloat16")
    ap.add_argument("--passes", type=int, default=2, help="decode everything this many times (the first is cold)")
    a = ap.parse_args()
    if a.compare:
        x, y = (torch.load(p) for p in a.compare)
        same = sum(torch.equal(p, q) for p, q in zip(x["hyps"], y["hyps"]))
        print(f"identical hypotheses: {same}/{len(x['hyps'])}; first pass {x['seconds']:.2f} s vs {y['seconds']:.2f} s "
              f"= {y['seconds'] / x['seconds']:.1f}x; last pass {x['warm']:.2f} s vs {y['warm']:.2f} s "
              f"= {y['warm'] / x['warm']:.1f}x")
        return
    from mhe.models import build_model
    from mhe.models.generation import beam_search

    torch.manual_seed(0)
    kernel = {"attn_kernel": a.kernel} if a.kernel else {}
    model = build_model("transformer-base", attention="mha", vocab_size=8000, dropout=0.0, attn_dropout=0.0, **kernel)
    if a.weights:
        model.load_state_dict(torch.load(a.weights))
    else:  # sharper output distributions than N(0, 0.02) gives, so near-ties do not decide the beams
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)
    if a.save_weights:
        torch.save(model.state_dict(), a.save_weights)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = model.to(dev, getattr(torch, a.dtype)).eval()
    srcs = sources(a.sentences, 8000)
    order = sorted(range(len(srcs)), key=lambda i: len(srcs[i]))
    extra = {"step_mode": a.step_mode} if "step_mode" in inspect.signature(beam_search).parameters else {}
    hyps: list[torch.Tensor] = [torch.empty(0)] * len(srcs)
    sec = [decode_all(model, srcs, order, hyps, dev, extra) for _ in range(a.passes)]
    print(f"{len(srcs)} sentences, beam 4, {a.dtype}{', kernel ' + a.kernel if a.kernel else ''}: "
          f"{' then '.join(f'{x:.2f}' for x in sec)} s ({extra or 'old beam search'}); "
          f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU'}")
    if a.out:
        torch.save({"hyps": hyps, "seconds": sec[0], "warm": sec[-1]}, a.out)


def decode_all(model, srcs, order, hyps, dev, extra) -> float:
    """Seconds to decode every source (hypotheses written into ``hyps``)."""
    from mhe.models.generation import beam_search

    if dev.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for k in range(0, len(order), 64):
        chunk = order[k:k + 64]
        width = max(len(srcs[i]) for i in chunk)
        src = torch.zeros(len(chunk), width, dtype=torch.long)
        for r, i in enumerate(chunk):
            src[r, :len(srcs[i])] = torch.tensor(srcs[i])
        src = src.to(dev)
        out = beam_search(model, src, src != 0, bos_id=1, eos_id=2, beam=4, max_len=100, alpha=0.6, **extra)
        for r, i in enumerate(chunk):
            row = out[r, 1:].tolist()
            row = row[:row.index(2)] if 2 in row else row
            hyps[i] = torch.tensor(row)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
