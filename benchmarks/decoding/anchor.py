"""An outside anchor for mhe's decode attention: FlashInfer's batch decode kernel on the same
caches, side by side, one card, one run (issue 62).

    python benchmarks/decode.py anchor [--presets llama-135m] [--batch 64] [--context 4096]
        [--tensor-cores auto] [--reps 50] [--json OUT.json]

For the attention shapes of each preset (llama-135m: 9 query heads of 64; llama-1.1b: 32) with an
MHA cache, a grouped one (GQA: 3 and 4 K/V heads) and MHE's one-K/V-head cache, bf16, every row's
cache full to ``--context`` positions (``decoding.split_k.inputs``): mhe's kernels (the policy's
for the cache: ``split-k-decode``, and ``sdpa`` for MHA; ``flash-decode`` for one head) and
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` reading the SAME key and value tensors
(``HND`` layout, one page a row: a cache ``[B, h_kv, S, d]`` is ``B`` pages of ``S`` positions, no
copy). Each is checked against SDPA in fp32 on the same bf16 inputs (max |difference|) and timed
as CUDA-graph replays: one call, and a step of N layers over N distinct caches
(``decoding.split_k.layered``); the rate is the K/V bytes over the time, as a fraction of the
card's copy bandwidth. FlashInfer's CUDA-core decode kernel takes group sizes 1, 2, 3, 4 and 8
only; ``--tensor-cores auto`` also runs its tensor-core variant (its prefill kernel), which
takes any group (MHE's 9 and 32 query heads on one K/V head). FlashInfer is imported and
JIT-built (the device's nvcc) inside a guard: where it is missing or fails, each of its cells
says why, and mhe's rows stand. Writes ``--json`` after every shape (``flashinfer_status``
first says "building": a run cut short by a timeout while nvcc runs says so).
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F

from decoding import split_k

SHAPES = {"llama-135m": (("mha", 9, 9), ("gqa", 9, 3), ("mhe", 9, 1)),
          "llama-1.1b": (("mha", 32, 32), ("gqa", 32, 4), ("mhe", 32, 1))}
CUDA_CORE_GROUPS = (1, 2, 3, 4, 8)
WORKSPACE = 128 * 2**20


def flashinfer_calls(q, hk: int, context: int, tensor_cores: str) -> tuple[dict, dict]:
    """``({name: call(k, v, key_range, dense)}, {name: why it cannot run})`` for FlashInfer's
    decode wrapper(s) on ``q`` ``[B, h_q, 1, d]`` over caches ``[B, hk, context, d]``."""
    import flashinfer

    b, hq, _, d = q.shape
    q3 = q.squeeze(2).contiguous()
    variants = {"off": (False,), "on": (True,), "auto": (False, True)}[tensor_cores]
    calls, why = {}, {}
    for cores in variants:
        name = f"flashinfer-{'tensor-core' if cores else 'cuda-core'}"
        if not cores and hq // hk not in CUDA_CORE_GROUPS:
            why[name] = f"group size {hq // hk} not among the CUDA-core kernel's {CUDA_CORE_GROUPS}"
            continue
        dev = q.device
        indptr = torch.arange(b + 1, dtype=torch.int32, device=dev)
        indices = torch.arange(b, dtype=torch.int32, device=dev)
        last = torch.full((b,), context, dtype=torch.int32, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.zeros(WORKSPACE, dtype=torch.uint8, device=dev), kv_layout="HND", use_cuda_graph=True,
            use_tensor_cores=cores, paged_kv_indptr_buffer=indptr.clone(), paged_kv_indices_buffer=indices.clone(),
            paged_kv_last_page_len_buffer=last.clone())
        wrapper.plan(indptr, indices, last, hq, hk, d, context, q_data_type=q.dtype, kv_data_type=q.dtype,
                     sm_scale=1 / math.sqrt(d))
        calls[name] = lambda k, v, kr, dense, w=wrapper: w.run(q3, (k, v)).unsqueeze(2)
    return calls, why


def shape_row(preset, kind, hq, hk, a, bandwidth, status: dict) -> dict:
    """mhe's kernels and FlashInfer's on one cache shape: errors, one call, a step of N layers."""
    q, k, v, kr = split_k.inputs(a.batch, hq, hk, a.context, torch.bfloat16)
    dense = split_k.range_mask(kr, a.context)
    gold = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    nbytes = 2 * k.numel() * k.element_size()
    calls = split_k.kernel_calls(q, hk)
    calls.pop("split-k-two-kernels")  # mhe's: split-k-decode, sdpa (MHA's policy), flash-decode (one head)
    out = {"preset": preset, "kind": kind, "batch": a.batch, "context": a.context, "h_q": hq, "h_kv": hk,
           "kv_bytes": nbytes, "flashinfer_skipped": {}}
    if status.get("usable"):
        try:
            more, why = flashinfer_calls(q, hk, a.context, a.tensor_cores)
            calls.update(more)
            out["flashinfer_skipped"].update(why)
        except Exception as e:  # noqa: BLE001  the anchor must not cost mhe's rows
            out["flashinfer_skipped"]["flashinfer"] = f"{type(e).__name__}: {str(e)[:400]}"
    else:
        out["flashinfer_skipped"]["flashinfer"] = status.get("reason", "not tried")
    for name, call in list(calls.items()):
        try:
            got = call(k, v, kr, dense)
            out[f"{name}_max_err"] = (got.float() - gold).abs().max().item()
            ms = split_k.timed(lambda: call(k, v, kr, dense), warmup=5, reps=a.reps, cuda=True, graph=True)
            out[f"{name}_ms"] = round(ms, 4)
            out[f"{name}_fraction_of_bandwidth"] = round(nbytes / (ms / 1e3) / bandwidth, 3)
        except Exception as e:  # noqa: BLE001  one kernel's failure is a cell, not the run's end
            where = "flashinfer_skipped" if name.startswith("flashinfer") else "failed"
            out.setdefault(where, {})[name] = f"{type(e).__name__}: {str(e)[:400]}"
            calls.pop(name)
    out.update(split_k.layered(q, hk, batch=a.batch, context=a.context, reps=a.reps, bandwidth=bandwidth,
                               calls=calls))
    return out


def try_flashinfer() -> dict:
    """Whether FlashInfer imports here, its version, and why not."""
    try:
        import flashinfer
    except Exception as e:  # noqa: BLE001  (ImportError, or a dependency that fails on import)
        return {"usable": False, "reason": f"import flashinfer failed: {type(e).__name__}: {str(e)[:400]}"}
    return {"usable": True, "version": getattr(flashinfer, "__version__", "?")}


def line(r: dict) -> str:
    names = [n[:-3] for n in r if n.endswith("_ms") and not n.endswith("_layer_ms")]
    cells = "  ".join(f"{n} {r[f'{n}_ms']:.4f} ms ({r[f'{n}_fraction_of_bandwidth']:.0%}; in {r['layers']} layers "
                      f"{r.get(f'{n}_layer_ms', float('nan')):.4f} ms, "
                      f"{r.get(f'{n}_layer_fraction_of_bandwidth', float('nan')):.0%}; err {r[f'{n}_max_err']:.1e})"
                      for n in names)
    skipped = "; ".join(f"{k}: {v}" for k, v in r["flashinfer_skipped"].items())
    return (f"{r['preset']:<11} {r['kind']:<4} B={r['batch']} S={r['context']} h_q={r['h_q']} h_kv={r['h_kv']} "
            f"{r['kv_bytes'] / 2**20:8.1f} MiB  {cells}" + (f"  [not run: {skipped}]" if skipped else ""))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="decode.py anchor", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="llama-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--tensor-cores", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("decode.py anchor: needs a CUDA GPU (FlashInfer and the Triton decode kernel)")
    start = time.perf_counter()
    bw = split_k.copy_bandwidth()
    result = {"card": torch.cuda.get_device_name(0), "torch": torch.__version__, "copy_bandwidth": bw,
              "flashinfer_status": "building", "rows": []}

    def save() -> None:
        if a.json:
            with open(a.json, "w") as f:
                json.dump(result, f, indent=1)
    status = try_flashinfer()
    result["flashinfer"] = status
    save()
    print(f"{result['card']}: copy bandwidth {bw / 1e12:.2f} TB/s; flashinfer {status}", flush=True)
    for preset in a.presets.split(","):
        for kind, hq, hk in SHAPES[preset]:
            result["rows"].append(shape_row(preset, kind, hq, hk, a, bw, status))
            save()
            print(line(result["rows"][-1]), flush=True)
    result["flashinfer_status"] = "done"
    result["seconds"] = round(time.perf_counter() - start, 1)
    save()
