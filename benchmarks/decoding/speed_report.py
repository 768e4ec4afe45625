"""The markdown of ``decode.py speed``: the issue's table, every row, the step modes side by side,
the long-context reading and issue 28's targets, all computed from the rows of one run."""

from __future__ import annotations

import torch

KINDS = ("mha", "mqa", "mhe-mul")


def environment(dev: torch.device) -> dict:
    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    return {"card": card, "torch": torch.__version__, "transformers": hf,
            "dtype": "bf16" if dev.type == "cuda" else "fp32"}


def find(rows, batch, context, path, kind=None, mode=None):
    """The first measured row of ``path`` (and ``kind``, a ``mode`` prefix) at (batch, context)."""
    for r in rows:
        if (r.get("batch"), r.get("context"), r.get("path")) == (batch, context, path) and "error" not in r \
                and (kind is None or r.get("kind") == kind) and (mode is None or r.get("mode", "").startswith(mode)):
            return r
    return None


def _ms(r, key="ms_per_token") -> str:
    return "-" if r is None or r.get(key) is None else f"{r[key]:.3f}"


def settings(rows) -> list[tuple[int, int]]:
    return sorted({(r["batch"], r["context"]) for r in rows if "batch" in r}, key=lambda s: (s[1], s[0]))


def main_table(rows) -> list[str]:
    """The issue's table: ms per generated token, every path in its default mode."""
    out = ["| batch, context | HF static (compiled) | MHA | MQA | MHE-Mul | HF adapter MHA / MHE-Mul | "
           "old tree MHA / MQA / MHE-Mul |", "|---|---:|---:|---:|---:|---:|---:|"]
    for b, c in settings(rows):
        hf = find(rows, b, c, "HF GPT-2 static")
        ours = [_ms(find(rows, b, c, "model.generate", k, "auto")) for k in KINDS]
        adapter = [find(rows, b, c, "HF adapter static", k) for k in ("mha", "mhe-mul")]
        old = [_ms(find(rows, b, c, "old tree model.generate", k)) for k in KINDS]
        hf_cell = _ms(hf) + ("" if hf is None or hf["mode"] == "compiled" else " (not compiled)")
        ad = " / ".join(_ms(r) for r in adapter) if any(adapter) else ""
        out.append(f"| {b}, {c:,} | {hf_cell} | " + " | ".join(ours) + f" | {ad} | {' / '.join(old)} |")
    return out


def _cell(r, key, fmt, scale=1.0) -> str:
    return "-" if r.get(key) is None else fmt.format(scale * r[key])


def detail_table(rows) -> list[str]:
    out = ["| batch, context | path | kind | mode | first call s | ms/token | tokens/s | decode ms/step | "
           "prefill ms | KV MiB | kernels/token | GPU us/token |", "|" + "---|" * 4 + "---:|" * 8]
    for r in rows:
        if "error" in r:
            out.append(f"| {r.get('batch')}, {r.get('context')} | {r.get('path', '')} | {r.get('kind', '')} | "
                       f"failed: {r['error'][:160]} |" + " |" * 8)
            continue
        cells = [_cell(r, "first_call_s", "{:.2f}"), _cell(r, "ms_per_token", "{:.3f}"),
                 _cell(r, "tokens_per_s", "{:,.0f}"), _cell(r, "decode_ms_per_step", "{:.3f}"),
                 _cell(r, "prefill_s", "{:.1f}", 1000), _cell(r, "kv_mib", "{:,.1f}"),
                 _cell(r, "kernels_per_token", "{:.0f}"), _cell(r, "busy_us_per_token", "{:.0f}")]
        out.append(f"| {r['batch']}, {r['context']:,} | {r['path']} | {r.get('kind', '')} | {r.get('mode', '')} | "
                   + " | ".join(cells) + " |")
    return out


def mode_lines(rows) -> list[str]:
    """Which step mode is fastest for each kind and size (what the default should be)."""
    out = []
    for b, c in settings(rows):
        for k in KINDS:
            mine = [r for r in rows if (r.get("batch"), r.get("context"), r.get("kind"), r.get("path")) ==
                    (b, c, k, "model.generate") and "error" not in r]
            if len(mine) > 1:
                best = min(mine, key=lambda r: r["ms_per_token"])
                out.append(f"* {b} x {c:,} {k}: " + ", ".join(
                    f"{r['mode']} {r['ms_per_token']:.3f} ms/token (first call {r['first_call_s']:.1f} s)"
                    for r in mine) + f"; fastest: {best['mode']}")
    return out


def long_context(rows) -> list[str]:
    """MHE-Mul against MHA at the longest context: end to end, the decode steps alone, the prefill's cap."""
    if not settings(rows):
        return []
    b, c = max(settings(rows), key=lambda s: (s[1], s[0]))
    mha, mhe = (find(rows, b, c, "model.generate", k, "auto") for k in ("mha", "mhe-mul"))
    if mha is None or mhe is None:
        return []
    e2e = mhe["tokens_per_s"] / mha["tokens_per_s"]
    steps = mha["decode_ms_per_step"] / mhe["decode_ms_per_step"]
    share = mhe["prefill_s"] / mhe["seconds"]
    return [f"Batch {b} x context {c:,}: MHE-Mul {e2e:.2f}x MHA's tokens/s end to end, {steps:.2f}x on the "
            f"decode steps alone ({mha['decode_ms_per_step']:.3f} vs {mhe['decode_ms_per_step']:.3f} ms/step). "
            f"The prefill (the same work for both kinds but the K/V projections: {1000 * mha['prefill_s']:.1f} vs "
            f"{1000 * mhe['prefill_s']:.1f} ms) is {100 * share:.0f}% of MHE-Mul's call and takes the ratio from "
            f"{steps:.2f}x to {e2e:.2f}x ({100 * (1 - e2e / steps):.0f}% lower)."]


def targets(rows) -> list[str]:
    """Issue 28's targets, read off this run."""
    out = []

    def say(text, ok):
        out.append(f"* {text}: {'met' if ok else 'missed'}")
    b1 = {k: find(rows, 1, 512, "model.generate", k, "auto") for k in KINDS}
    hf1 = find(rows, 1, 512, "HF GPT-2 static")
    if b1["mha"] and b1["mhe-mul"]:
        worst = max(b1["mha"]["ms_per_token"], b1["mhe-mul"]["ms_per_token"])
        say(f"batch 1: {worst:.3f} ms/token at most (<= 0.45)", worst <= 0.45)
        if hf1:
            say(f"batch 1: {hf1['ms_per_token'] / worst:.2f}x HF's static-cache generate at least (>= 3.5x)",
                hf1["ms_per_token"] / worst >= 3.5)
        say("batch 1: MHE-Mul <= MHA", b1["mhe-mul"]["ms_per_token"] <= b1["mha"]["ms_per_token"])
    for b in (1, 64):
        ours = {k: find(rows, b, 512, "model.generate", k, "auto") for k in ("mha", "mhe-mul")}
        ad = {k: find(rows, b, 512, "HF adapter static", k) for k in ("mha", "mhe-mul")}
        if all(ours.values()) and all(ad.values()):
            worst = max(ad[k]["ms_per_token"] / ours[k]["ms_per_token"] for k in ad)
            say(f"batch {b}: the adapter within {worst:.2f}x of model.generate (<= 1.2x)", worst <= 1.2)
            say(f"batch {b}: adapter MHE-Mul <= MHA", ad["mhe-mul"]["ms_per_token"] <= ad["mha"]["ms_per_token"])
    mha, mhe = (find(rows, 64, 4096, "model.generate", k, "auto") for k in ("mha", "mhe-mul"))
    if mha and mhe:
        ratio = mhe["tokens_per_s"] / mha["tokens_per_s"]
        say(f"batch 64 x 4,096: MHE-Mul {ratio:.2f}x MHA end to end (>= 2.5x)", ratio >= 2.5)
    return out


def report(rows, env: dict, *, new: int) -> str:
    head = (f"# Decoding speed: {env['card']}, torch {env['torch']}, transformers {env['transformers']}, "
            f"{env['dtype']}\n\n{new} new tokens per call (greedy, no stop token, prefill included); ms per "
            "generated token, the median of the calls after the first; default step modes.\n")
    parts = [head, *main_table(rows), "", "## Every row", "", *detail_table(rows), "", "## Step modes", "",
             *mode_lines(rows), "", "## Long context", "", *long_context(rows), "", "## Targets (issue 28)", "",
             *targets(rows), ""]
    return "\n".join(parts)
