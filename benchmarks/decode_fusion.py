"""What the batch-1 decode step launches, and what inductor's other settings make of it (issue 28).

    python benchmarks/decode_fusion.py OUT [--kinds mha,mqa,mhe-mul] [--variants default,sdpa,autotune]
        [--context 512] [--new 256] [--deadline 540] [--cpu-smoke]

For each attention kind, ``build_model("gpt2-base", attention=K, max_len=context)`` in bf16 runs
``model.generate(ids, new, attention_mask=mask, **variant)`` at batch 1 (random weights, greedy,
no stop token, prefill included; the first call, then the median of 3) in each variant:

* ``default``: the user's call (the step compiled by inductor, captured with the token choice);
* ``sdpa``: the attention kernel ``sdpa`` in place of the automatic choice (``flash-decode``
  for one-K/V-head caches: MQA, MHE);
* ``expand``: the attention kernel ``sdpa-expand`` (a one-K/V-head cache expanded to every
  query head without a copy, so SDPA may take its cuDNN kernel, as for MHA);
* ``autotune``: ``compile_options={"mode": "max-autotune-no-cudagraphs"}`` (inductor may pick
  its own Triton matrix-product kernels and fuse the bias, activation and residual into them);
* ``coordinate``: ``compile_options={"options": {"coordinate_descent_tuning": True}}``;
* ``combo``: ``compile_options={"options": {"combo_kernels": True}}`` (inductor launches
  independent small kernels, such as the key and value cache writes, as one).

Beside the time it counts what one more token launches (the difference of a 20-token and a
4-token call under the profiler), by kernel name, so the table shows which kernels a fused step
would have to remove. Writes ``OUT/decode-fusion.md`` and ``OUT/decode-fusion.json`` (rewritten
after every row). ``--cpu-smoke`` runs tiny sizes on a CPU (leaf operators in place of kernels).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
import decode_rows as rows_mod  # noqa: E402

VARIANTS = {
    "default": {},
    "sdpa": {"kernel": "sdpa"},
    "expand": {"kernel": "sdpa-expand"},
    "autotune": {"compile_options": {"mode": "max-autotune-no-cudagraphs"}},
    "coordinate": {"compile_options": {"options": {"coordinate_descent_tuning": True}}},
    "combo": {"compile_options": {"options": {"combo_kernels": True}}},
}


def kernel_names(model, ids, mask, dev, options, lengths=(4, 20)) -> collections.Counter:
    """Kernels (GPU) or leaf operators (CPU) one more token launches, by name (per token)."""
    counts = []
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for n in lengths:
        model.generate(ids, n, attention_mask=mask, **options)
        rows_mod.sync(dev)
        with profile(activities=acts) as prof:
            model.generate(ids, n, attention_mask=mask, **options)
            rows_mod.sync(dev)
        if dev.type == "cuda":
            names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        else:
            names = [e.name for e in prof.events() if e.name.startswith("aten::") and not e.cpu_children]
        counts.append(collections.Counter(n[:90] for n in names))
    steps = lengths[1] - lengths[0]
    diff = collections.Counter({k: (counts[1][k] - counts[0][k]) / steps for k in counts[1]})
    return collections.Counter({k: v for k, v in diff.items() if v > 0})


def measure(a, dev, dtype, out: Path) -> list[dict]:
    rows, start = [], time.perf_counter()
    for kind in a.kinds.split(","):
        for name in a.variants.split(","):
            if name == "sdpa" and kind == "mha":
                continue  # MHA's caches have 12 K/V heads: its automatic choice is sdpa already
            if time.perf_counter() - start > a.deadline:
                rows.append({"kind": kind, "variant": name, "skipped": "past the deadline"})
                continue
            model = rows_mod.build(a.preset, kind, a.context, dev, dtype, a.cpu_smoke)
            ids, mask = rows_mod.prompts(model, 1, a.context - a.new, dev)
            options = VARIANTS[name]
            row = {"kind": kind, "variant": name, **rows_mod.generate_row(model, ids, mask, a.new, dev, 3, **options)}
            names = kernel_names(model, ids, mask, dev, options)
            row["kernels_per_token"] = sum(names.values())
            row["kernels"] = dict(names.most_common())
            rows.append(row)
            print(f"{kind:8s} {name:10s} {row['ms_per_token']:.3f} ms/token  {row['kernels_per_token']:.0f} kernels"
                  f"  first call {row['first_call_s']:.1f} s", flush=True)
            del model
            rows_mod.release(dev)
            write(out, rows, dev)
    return rows


def write(out: Path, rows: list[dict], dev) -> None:
    card = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    (out / "decode-fusion.json").write_text(json.dumps({"card": card, "torch": torch.__version__, "rows": rows},
                                                       indent=1))
    lines = [f"# Batch-1 decode step: kernels and inductor settings\n", f"Card: {card}; torch {torch.__version__}\n",
             "| kind | variant | ms/token | decode ms/step | kernels/token | first call s |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['kind']} | {r['variant']} | skipped | | | |")
            continue
        lines.append(f"| {r['kind']} | {r['variant']} | {r['ms_per_token']:.3f} | {r['decode_ms_per_step']:.3f} | "
                     f"{r['kernels_per_token']:.1f} | {r['first_call_s']:.1f} |")
    for r in rows:
        if "kernels" in r:
            lines += ["", f"## {r['kind']} {r['variant']}: kernels per token", "", "| per token | kernel |",
                      "|---:|---|"]
            lines += [f"| {v:.2f} | `{k}` |" for k, v in r["kernels"].items()]
    (out / "decode-fusion.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--kinds", default="mha,mqa,mhe-mul")
    ap.add_argument("--variants", default="default,sdpa,autotune")
    ap.add_argument("--preset", default="gpt2-base")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds; later rows are skipped")
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    if a.cpu_smoke:
        a.context, a.new = 48, 24
    bad = [v for v in a.variants.split(",") if v not in VARIANTS]
    if bad:
        raise SystemExit(f"decode_fusion.py: unknown variant {bad[0]!r}; allowed: {', '.join(VARIANTS)}")
    dev = torch.device("cuda" if torch.cuda.is_available() and not a.cpu_smoke else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    measure(a, dev, dtype, out)


if __name__ == "__main__":
    main()
