"""A decode step's matrix products at 1, 8 and 64 rows: cuBLAS (``F.linear``, what the compiled
step calls) against a Triton product made for few rows (tiles narrow in N, optionally split over K;
the best of 24 launch settings a shape, of which four ask for more shared memory than a Hopper SM
has and fail), on llama-135m's and llama-1.1b's shapes (the Q/K/V product is MQA's). The question
it answers for issue 41: do 64-row products read their weights faster with a kernel of our own?

    python benchmarks/skinny_products.py [OUT.json]      # one CUDA GPU; prints the card

Each time is a CUDA graph of 40 back-to-back calls on one weight, replayed (the median of 5
replays, over 40): launch gaps as in a captured step, but a weight that fits the L2 may be read
partly from it, so these compare kernels and are not a step's times. Results beside the command
in ``docs/benchmarks.md`` section 12 (``results/logs/skinny-products-*``)."""
import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _skinny(X, W, Y, M, N, K, sxm, swn, sym, syk, K_PER,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_k * K_PER
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(k0, k0 + K_PER, BLOCK_K):
        kk = k + rk
        x = tl.load(X + rm[:, None] * sxm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(W + rn[:, None] * swn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        tl.store(Y + rm[:, None] * sym + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(Y + pid_k * syk + rm[:, None] * sym + rn[None, :], acc, mask=mask)


def skinny(x, w, block_n, block_k, split, warps, stages):
    m, k = x.shape
    n = w.shape[0]
    bm = max(16, triton.next_power_of_2(m))
    k_per = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_per)
    if split == 1:
        y = torch.empty(m, n, device=x.device, dtype=x.dtype)
        _skinny[(triton.cdiv(n, block_n), 1)](x, w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0), 0, k_per,
                                               BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=1,
                                               num_warps=warps, num_stages=stages)
        return y
    p = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    _skinny[(triton.cdiv(n, block_n), split)](x, w, p, m, n, k, x.stride(0), w.stride(0), p.stride(1), p.stride(0),
                                               k_per, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=split,
                                               num_warps=warps, num_stages=stages)
    return p.sum(0).to(x.dtype)


def timed(fn, reps=40, tries=5):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(tries):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / reps)
    times.sort()
    return times[len(times) // 2]


SHAPES = {  # (name, K, N): one layer's decode products; "qkv" is MQA's (a full query and one K/V head of
    # 64); MHE-Mul's is one head each (N = 192), smaller still, and not measured here
    "135m": [("qkv", 576, 704), ("o", 576, 576), ("gate_up", 576, 3072), ("down", 1536, 576), ("lm_head", 576, 49152)],
    "1.1b": [("qkv", 2048, 2176), ("o", 2048, 2048), ("gate_up", 2048, 11264), ("down", 5632, 2048),
             ("lm_head", 2048, 32000)],
}


def main():
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    configs = list(itertools.product((16, 32, 64), (128, 256), (1, 2, 4, 8), (4,), (4,)))
    print("card", torch.cuda.get_device_name(0), "torch", torch.__version__, "triton", triton.__version__, flush=True)
    for model, shapes in SHAPES.items():
        for (name, k, n), m in itertools.product(shapes, (1, 8, 64)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
            want = x.double() @ w.double().T
            ref = F.linear(x, w)
            err_ref = (ref.double() - want).abs().max().item()
            t_ref = timed(lambda: F.linear(x, w))
            best = None
            for c in configs:
                try:
                    y = skinny(x, w, *c)
                    err = (y.double() - want).abs().max().item()
                    if err > 4 * err_ref + 1e-2:
                        print("  wrong", model, name, m, c, err, err_ref, flush=True)
                        continue
                    t = timed(lambda: skinny(x, w, *c))
                except Exception as e:  # noqa: BLE001
                    print("  failed", c, type(e).__name__, str(e)[:120], flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, c, err)
            if best is None:
                print(f"  no setting ran for {model} {name} m={m}", flush=True)
                continue
            gb = (n * k * 2 + m * k * 2 + m * n * 2) / 1e9
            row = {"model": model, "product": name, "m": m, "k": k, "n": n, "cublas_us": round(t_ref, 2),
                   "triton_us": round(best[0], 2), "config": best[1], "cublas_TBs": round(gb / t_ref * 1e6 / 1e3, 2),
                   "triton_TBs": round(gb / best[0] * 1e6 / 1e3, 2), "err": best[2], "err_cublas": err_ref}
            rows.append(row)
            print(f"{model:5s} {name:8s} m={m:3d} K={k:5d} N={n:6d}  "
                  f"cublas {t_ref:7.2f} us {row['cublas_TBs']:5.2f} TB/s"
                  f"  triton {best[0]:7.2f} us {row['triton_TBs']:5.2f} TB/s  {best[1]}", flush=True)
    json.dump(rows, open(sys.argv[1] if len(sys.argv) > 1 else "skinny.json", "w"), indent=1)


if __name__ == "__main__":
    main()
