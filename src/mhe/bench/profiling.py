"""Reading a ``torch.profiler`` trace of training steps (``benchmarks/train_bench.py profile``):
GPU time per step by kind of kernel, which SDPA backend each attention call ran on, and the SDPA
backends side by side at the training shapes (GPT-2's, or a preset's own with the layouts its
attention sublayers give them: :func:`model_attention_inputs`).

Kernels are sorted by name into :data:`CATEGORIES`. A kernel torch.compile fused from several
operations is counted once, in the first category of :data:`CATEGORIES` its name matches
(Inductor names its kernels after the operations they fuse, e.g.
``triton_poi_fused_add_native_dropout_native_layer_norm_3`` counts as layernorm), so the cost of
dropout is measured by turning it off, not read from its category.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mhe.attention.masks import AttentionMask
from mhe.attention import attention_spec, kernels
from mhe.bench.common import timed

CATEGORIES = ("attention fwd", "attention bwd", "optimizer", "matmul/GEMM", "cross-entropy/loss", "copies/casts",
              "layernorm", "dropout/RNG", "communication", "other elementwise/fused", "other")
_RULES = (  # (category, name fragments), tried in this order
    ("communication", ("nccl", "allreduce", "all_reduce", "reduce_scatter", "all_gather")),  # DDP's collectives
    ("attention bwd", ("flash_bwd", "fmha_cutlassb", "bprop", "dot_do_o", "convert_dq")),
    ("attention fwd", ("flash_fwd", "fmha_cutlassf", "fprop")),
    ("optimizer", ("adam", "multi_tensor_apply", "lpnorm", "foreach")),
    ("matmul/GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "splitk", "triton_tem")),
    ("cross-entropy/loss", ("logsumexp", "nll_loss", "log_softmax", "cross_entropy")),
    ("copies/casts", ("memcpy", "memset", "copy_kernel")),
    ("layernorm", ("layer_norm", "layernorm", "rsqrt")),  # LayerNorm, or RMSNorm fused by Inductor
    ("dropout/RNG", ("dropout", "inductor_random", "inductor_seeds", "philox", "bernoulli")),
)
_COPY_WORDS = {"", "to", "copy", "t", "clone", "cat", "permute", "transpose", "view", "slice", "select", "unsqueeze",
               "squeeze", "expand", "zeros", "like", "new", "full", "lift", "fresh", "constant", "pad", "nd"}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def kernel_category(name: str) -> str:
    """The category of :data:`CATEGORIES` a GPU kernel's name belongs to."""
    n = name.lower()
    for category, fragments in _RULES:
        if any(f in n for f in fragments):
            return category
    fused = re.match(r"triton_(?:poi|red|per)_fused_(.*?)(?:_\d+)?$", n)
    if fused:
        words = set(fused.group(1).split("_"))
        if "exp" in words and words & {"gather", "scatter", "masked", "logsumexp"}:
            return "cross-entropy/loss"  # the chunked loss's gradient pass (mhe.models.losses)
        return "copies/casts" if words <= _COPY_WORDS else "other elementwise/fused"
    if any(f in n for f in ("elementwise", "reduce_kernel", "vectorized", "triton")):
        return "other elementwise/fused"
    return "other"


def kernel_times(prof, steps: int) -> dict[str, tuple[float, float]]:
    """GPU kernel (and copy) name -> (ms per step, launches per step), from a profile of ``steps`` steps."""
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0 and e.device_type.name == "CUDA":
            out[e.key] = (t / steps / 1000, e.count / steps)
    return out


def by_category(times: dict[str, tuple[float, float]]) -> dict[str, float]:
    """ms per step in each of :data:`CATEGORIES` (every category present, 0 when empty)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, (ms, _) in times.items():
        out[kernel_category(name)] += ms
    return out


def sdpa_calls(prof, steps: int) -> str:
    """Which SDPA backend the attention calls of the profiled steps ran on, per step, e.g.
    ``flash 12 fwd / 12 bwd`` (the aten operators torch.compile's code or eager SDPA called)."""
    seen: dict[str, list[float]] = {}
    for e in prof.key_averages():
        m = re.match(r"aten::_scaled_dot_product_(flash|efficient|cudnn|fused)_attention(_for_cpu)?(_backward)?$",
                     e.key) or re.match(r"aten::_scaled_dot_product_attention_(math)(_for_mps)?()$", e.key)
        if m:
            fwd_bwd = seen.setdefault(m.group(1), [0.0, 0.0])
            fwd_bwd[1 if m.group(3) else 0] += e.count / steps
    if not seen:
        return _attention_kernels(prof, steps) or "none (decomposed into matrix products)"
    return ", ".join(f"{k} {f:g} fwd / {b:g} bwd" for k, (f, b) in sorted(seen.items()))


# Attention kernels by name, for steps replayed as CUDA graphs (whose aten operators the profiler
# does not record): FlashAttention-2 (PyTorch's copy), cuDNN's SDPA, the memory-efficient (CUTLASS) one.
_ATTENTION_KERNELS = (("flash", r"flash_fwd_(splitkv_)?kernel", r"flash_bwd_dq_dk_dv"),
                      ("cudnn", r"cudnn\S*sdpa\S*fprop", r"cudnn\S*sdpa\S*bprop"),
                      ("efficient", r"fmha_cutlassF", r"fmha_cutlassB"))


def _attention_kernels(prof, steps: int) -> str:
    """The attention kernels' launches per step read from their names, e.g. ``flash 12 fwd / 12
    bwd (kernels of a CUDA-graph replay)``; "" when there are none."""
    seen: dict[str, list[float]] = {}
    for e in prof.key_averages():
        if e.device_type.name != "CUDA":
            continue
        for backend, fwd, bwd in _ATTENTION_KERNELS:
            for i, pattern in enumerate((fwd, bwd)):
                if re.search(pattern, e.key):
                    seen.setdefault(backend, [0.0, 0.0])[i] += e.count / steps
    if not seen:
        return ""
    return ", ".join(f"{k} {f:g} fwd / {b:g} bwd" for k, (f, b) in sorted(seen.items())) + " (kernels of a CUDA-graph replay)"


def _attention_inputs(kind: str, seq: int, dev, batch: int = 32, heads: int = 12, d: int = 64):
    """q, k, v with the layouts the model's projections give them: ``[B, T, h*d]`` viewed as
    ``[B, h, T, d]``; MQA's one K/V head split the same way, MHE's unsqueezed (``mhe.attention``)."""
    T = seq
    q = torch.randn(batch, T, heads * d, device=dev, dtype=torch.bfloat16).view(batch, T, heads, d).transpose(1, 2)
    spec = attention_spec(kind)
    if spec.is_mhe:  # the one shared head, unsqueezed
        kv = [torch.randn(batch, T, d, device=dev, dtype=torch.bfloat16).unsqueeze(1) for _ in range(2)]
    else:  # g heads split from [B, T, g*d]: n for MHA, one for MQA
        g = spec.kv_heads(heads, spec.options())
        kv = [torch.randn(batch, T, g * d, device=dev, dtype=torch.bfloat16).view(batch, T, g, d)
              .transpose(1, 2) for _ in range(2)]
    return [t.detach().requires_grad_() for t in (q, *kv)]


def model_attention_inputs(cfg, batch: int, seq: int, dev) -> list[torch.Tensor]:
    """q, k, v of the first attention sublayer of a one-layer model of ``cfg``, from its own
    projection hooks under bf16 autocast (rotary positions and MHE's per-head factors included),
    with the strides the model gives them; leaves that require grad."""
    from mhe.attention import Attention
    from mhe.models import build_model

    attn = next(m for m in build_model(cfg.replace(n_layers=1)).to(dev).modules() if isinstance(m, Attention))
    x, pos = torch.randn(batch, seq, cfg.d_model, device=dev), torch.arange(seq, device=dev)
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        q, (k, v) = attn._queries(x, pos), attn._keys_values(x, pos)  # [B, h_q, T, d], 2 x [B, h_kv, T, d]
    # MHE's float32 head factors promote the queries; the model casts them to the keys' dtype before attending
    return [t.detach().to(k.dtype).requires_grad_() for t in (q, k, v)]


GPT2_SETTINGS = ((True, 0.1), (True, 0.0), (False, 0.1), (False, 0.0))


def sdpa_backend_rows(dev, seq: int = 512, inputs: dict | None = None, settings=GPT2_SETTINGS) -> list[dict]:
    """For each K/V layout of ``inputs`` (label -> a function returning q, k, v; default: MHA's,
    MQA's and MHE-Mul's at GPT-2's shapes) and each (causal, dropout) of ``settings``: the backend
    SDPA picks, the one mhe's ``sdpa`` kernel runs on, and forward+backward ms of mhe's kernel, of
    mhe's kernel on K/V expanded to every head (grouped K/V only), and of each backend forced
    (None where it refuses the inputs)."""
    inputs = inputs or {k: (lambda k=k: _attention_inputs(k, seq, dev)) for k in ("mha", "mqa", "mhe-mul")}
    rows = []
    for kind, make in inputs.items():
        for causal, p in settings:
            q, k, v = make()
            gqa = k.shape[1] != q.shape[1]
            choice = torch._fused_sdp_choice(q, k, v, None, p, causal, scale=None, enable_gqa=gqa)
            ours = kernels.sdpa_backends(q, k, v, dict(dropout_p=p, is_causal=causal, enable_gqa=gqa))
            row = {"kind": kind, "causal": causal, "dropout": p, "sdpa_choice": _backend_name(choice)}
            if ours is not None:
                with sdpa_kernel(ours):
                    row["mhe_choice"] = _backend_name(torch._fused_sdp_choice(q, k, v, None, p, causal, scale=None,
                                                                              enable_gqa=gqa))
            else:
                row["mhe_choice"] = row["sdpa_choice"]
            step = lambda: kernels.attend(q, k, v, AttentionMask(causal=causal), dropout_p=p).sum().backward()  # noqa: E731
            row["mhe_ms"] = timed(step, warmup=3, reps=10, cuda=True)
            row["expand_ms"] = _expanded_ms(q, k, v, causal, p) if gqa else None
            for name, backend in BACKENDS.items():
                row[f"{name}_ms"] = _forced_ms(backend, q, k, v, causal, p, gqa)
            rows.append(row)
    return rows


def _expanded_ms(q, k, v, causal, p) -> float:
    """mhe's kernel with the K/V heads repeated to every query head (one head: a stride-0 view, no
    copy; g heads: each repeated n/g times, a copy)."""
    b, g, s, d = k.shape
    n = q.shape[1]

    def repeat(t):
        return t.expand(-1, n, -1, -1) if g == 1 else t[:, :, None].expand(b, g, n // g, s, d).reshape(b, n, s, d)

    def step():
        ke, ve = repeat(k), repeat(v)  # [B, n, S, d]
        kernels.attend(q, ke, ve, AttentionMask(causal=causal), dropout_p=p).sum().backward()
    return timed(step, warmup=3, reps=10, cuda=True)


def _forced_ms(backend, q, k, v, causal, p, gqa) -> float | None:
    def step():
        with sdpa_kernel([backend]):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=p, enable_gqa=gqa).sum().backward()
    try:
        return timed(step, warmup=2, reps=10, cuda=True)
    except RuntimeError:
        return None


def _backend_name(value: int) -> str:
    for name, backend in BACKENDS.items():
        if int(backend) == int(value):
            return name
    return f"backend {int(value)}"


def dropout_rates(dev, p: float = 0.1, batch: int = 16, heads: int = 12, seq: int = 512, d: int = 64) -> dict:
    """The dropout rate each SDPA backend really applies at ``p``, and the rate its scaling
    implies (1 - 1/kept value): every query attends (weight ~1) to key 0 alone, whose value is
    1, so an output is 0 where that weight was dropped and 1/(1 - p) elsewhere."""
    q = torch.zeros(batch, seq, heads, d, device=dev, dtype=torch.bfloat16)
    k, v = torch.zeros_like(q), torch.zeros_like(q)
    q[..., 0], k[:, 0, :, 0], v[:, 0] = 64.0, 8.0, 1.0  # score 64 on key 0, 0 elsewhere
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, h, T, d] with the projections' strides
    out = {}
    for name, backend in BACKENDS.items():
        try:
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q, k, v, dropout_p=p)[..., 0].float()
        except RuntimeError:
            out[name] = None
            continue
        kept = o[o != 0]
        out[name] = {"dropped": (o == 0).float().mean().item(),
                     "scale_rate": (1 - 1 / kept.mean()).item() if kept.numel() else None}
    return out
