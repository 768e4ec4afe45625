"""Eager against graph-replayed decoding, token by token (the check behind
``tests/test_decode_gpu.py::test_graph_region_samples_the_eager_tokens``).

    python benchmarks/decode_graph_diag.py     # one CUDA GPU, under a minute

For MHA and MHE-Mul (the tiny decoder in bf16), left-padded prompts or not, seeded sampling or
greedy, it prints the first new token whose logits differ between two eager calls, between eager
and graph replay, and between two graph calls (``None``: every logit is bit-equal), with the largest
difference there, and the kernel the decode policy picked. Output: ``results/logs/gpu-tests/``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if not os.environ.get("PYTHONPATH"):  # PYTHONPATH=OTHER/src runs another tree
    sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

from mhe.attention import kernels  # noqa: E402
from mhe.models import build_model  # noqa: E402


def tiny(kind: str):
    torch.manual_seed(0)
    return build_model("tiny-decoder", attention=kind, dropout=0.0, attn_dropout=0.0).cuda().to(torch.bfloat16).eval()


def prompts(padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 1024, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0
    return ids, mask


def first_diff(a: torch.Tensor, b: torch.Tensor):
    """(new token, max |difference|, differing logits) of the first token whose logits differ."""
    for t in range(a.shape[1]):
        if not torch.equal(a[:, t], b[:, t]):
            d = (a[:, t].float() - b[:, t].float()).abs()
            return t, float(d.max()), int((d > 0).sum())
    return None


def compare(kind: str, padded: bool, sample: bool) -> str:
    model = tiny(kind)
    ids, mask = prompts(padded)
    kw = dict(attention_mask=mask, return_logits=True)
    if sample:
        kw.update(do_sample=True, temperature=0.9, top_k=50, top_p=0.9, seed=7)
    eager, graph = (model.generator(3, 30, step_mode=m) for m in ("eager", "graph"))
    (e1, l1), (e2, l2), (g1, m1), (g2, m2) = (model.generate(ids, 20, session=s, **kw)
                                              for s in (eager, eager, graph, graph))
    policy = kernels.decode_kernel(model, "cuda", torch.bfloat16, batch=3, positions=30)
    return (f"{kind:8s} padded={padded} sample={sample} kernel={policy} eager-vs-eager {first_diff(l1, l2)} "
            f"eager-vs-graph {first_diff(l1, m1)} graph-vs-graph {first_diff(m1, m2)} "
            f"tokens-equal {torch.equal(e1, g1) and torch.equal(g1, g2)}")


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    print(torch.cuda.get_device_name(0), torch.__version__)
    for kind in ("mha", "mhe-mul"):
        for padded in (True, False):
            for sample in (True, False):
                print(compare(kind, padded, sample), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
