"""The attention step itself: softmax(q k^T / sqrt(d)) v (paper Eq. 3), as registered kernels.

This is the only module that knows how attention is computed. A *kernel* is a function
``kernel(q, k, v, *, mask, is_causal, dropout_p, scale) -> out`` with ``q: [B, h_q, T, d]``,
``k, v: [B, h_kv, S, d]`` (h_kv divides h_q; query head i reads key/value head
``i // (h_q / h_kv)``) and ``mask`` boolean, broadcastable to ``[B, h, T, S]`` (True =
attend). Kernels are chosen by name (``AttentionConfig.kernel``, ``ModelConfig.attn_kernel``: the
model's configured kernel; a decoding run's :class:`DecodePlan`, passed down its forward calls),
the way Hugging Face's ``AttentionInterface`` registers kernels apart from architectures:

* ``sdpa`` (default): ``torch.nn.functional.scaled_dot_product_attention`` with grouped
  heads through ``enable_gqa``; one new token over a grouped cache stacks the query heads
  of a group as query rows of one head. A CUDA call with a dropout rate cuDNN would round
  (no multiple of 1/16) runs on the other backends (:func:`exact_dropout_backends`), and so
  does a training call over grouped K/V heads (:func:`grouped_grad_backends`), unless it is long
  enough to train faster on cuDNN over the grouped heads (:func:`cudnn_for_grad`). A grouped call
  no fused backend of the installed torch reads natively (a mask, float32 on CUDA before torch
  2.14) gets its K/V heads repeated instead of the math backend (:func:`grouped_natively`).
* ``sdpa-expand``: as ``sdpa`` but key/value heads are repeated to the query heads first.
* ``eager``: the softmax written out (tests, attention maps).
* ``matmul-decode``: as ``sdpa``, except one-token grouped decoding is an explicit
  matmul -> softmax -> matmul, a point of comparison for SDPA's decode path (docs/benchmarks.md
  section 3 compares them).
* ``flash-decode`` (``attention/flash_decode.py``): as ``sdpa``, except one new token over a
  one-K/V-head cache ``[B, 1, S, d]`` on CUDA in fp16/bf16 runs FlashAttention-2's split-KV
  ("flash-decoding") forward; the mask must allow one contiguous run of keys per batch row.
  Generation chooses it on a GPU for MQA, SHA and folded MHE (:func:`decode_kernel`).
  It registers ``reads_key_range``: for one causal query the model hands it a run of keys
  per row instead of a mask (:mod:`mhe.attention.masks`).
* ``split-k-decode`` (``attention/triton_decode.py``): as ``sdpa``, except one new token over a
  cache with fewer K/V heads than query heads (MQA, SHA, fast MHE, GQA) on CUDA runs two Triton
  kernels: the query heads sharing a K/V head packed in one tile, so each K/V byte is read once,
  and the keys split across the card; it runs any cache, MHA's too, as groups of one. It reads
  key ranges as ``flash-decode`` does. Generation chooses it wherever Triton is installed for
  caches with fewer K/V heads, and for every cache at batch 1 in half precision
  (:func:`decode_kernel`).
* ``eager-one-token``: ``eager`` for one-token queries (a decode step), ``sdpa`` otherwise;
  generation picks it for fp32 decoding on CUDA, where SDPA has no fast fp32 one-query
  kernel (docs/benchmarks.md section 6).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend
from torch.nn.attention import sdpa_kernel as restrict_backends

from mhe.errors import MheError, one_of

if TYPE_CHECKING:
    from mhe.attention.masks import AttentionMask

Kernel = Callable[..., torch.Tensor]
_KERNELS: dict[str, Kernel] = {}  # read as KERNELS (below), which first loads the PLUGINS

PLUGINS = ("mhe.attention.flash_decode", "mhe.attention.triton_decode")
"""The modules of further kernels (``flash-decode``, ``split-k-decode``), each registering itself
when imported. This registry imports none of them: they are loaded on the first lookup of a name
not registered yet and whenever :data:`KERNELS` is read, so building or importing a model loads
no Triton code."""


def _load_plugins() -> None:
    for module in PLUGINS:
        importlib.import_module(module)


def _loaded(name: str) -> None:
    """Load the plugins when ``name`` is not registered yet (it may be one of theirs)."""
    if name not in _KERNELS:
        _load_plugins()


def __getattr__(name: str):
    if name == "KERNELS":  # every kernel by name, the plugins' included
        _load_plugins()
        return _KERNELS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
_READS_KEY_RANGE: set[str] = set()
_ADDITIVE_MASK: set[str] = set()
_READS_FACTORED: set[str] = set()


class FactoredQuery(NamedTuple):
    """The query heads of MHE under rotary positions, not yet made: one rotated query a row and
    the per-head factors (MHE-Mul) or offsets (MHE-Add) that make its ``n`` heads,
    ``head_i = shared * factors[i]`` (or ``+``). A kernel that reads it
    (``register_kernel(..., reads_factored_query=True)``: ``split-k-decode``) applies them as it
    loads the query, so a decode step writes no ``[B, n, 1, d]`` query (a kernel a layer fewer:
    the rotation of the shared query joins the key's, same shape); :func:`attend` makes the heads
    for every other kernel, as the sublayer did before.

    Attributes:
        shared: ``[B, 1, T, d]``, the rotated shared query.
        factors: ``[n, d]``, in ``shared``'s dtype.
        add: offsets (MHE-Add) rather than factors (MHE-Mul).
    """

    shared: torch.Tensor
    factors: torch.Tensor
    add: bool = False

    def heads(self) -> torch.Tensor:
        """``[B, n, T, d]``, laid out ``[B, T, n, d]`` as every kind's split query heads are."""
        a = self.shared.transpose(1, 2)  # [B, T, 1, d]
        return (a + self.factors if self.add else a * self.factors).transpose(1, 2)


def register_kernel(name: str, *, reads_key_range: bool = False, additive_mask: bool = False,
                    reads_factored_query: bool = False):
    """Function decorator adding an attention kernel under ``name``. ``reads_key_range``: for one
    causal query the kernel takes a run of keys per row (``key_range``) in place of a mask, and
    the model builds that instead (:func:`mhe.attention.masks.self_attention_mask`).
    ``additive_mask``: the kernel takes its mask as 0 / -inf in the query's dtype as well as
    boolean, and the forward converts it once for every layer
    (:meth:`mhe.attention.masks.AttentionMask.for_kernel`). ``reads_factored_query``: the kernel
    takes a :class:`FactoredQuery` as ``q`` (and makes its heads itself where it cannot apply it)."""
    def deco(fn: Kernel) -> Kernel:
        _KERNELS[name] = fn
        for flag, names in ((reads_key_range, _READS_KEY_RANGE), (additive_mask, _ADDITIVE_MASK),
                            (reads_factored_query, _READS_FACTORED)):
            if flag:
                names.add(name)
        return fn
    return deco


def reads_factored_query(name: str) -> bool:
    """Whether kernel ``name`` takes a :class:`FactoredQuery` (else :func:`attend` makes the heads)."""
    _loaded(name)
    return name in _READS_FACTORED


def takes_additive_mask(name: str) -> bool:
    """Whether kernel ``name`` reads an additive mask (SDPA: it converts a boolean one at every call)."""
    _loaded(name)
    return name in _ADDITIVE_MASK


def reads_key_range(name: str) -> bool:
    """Whether kernel ``name`` reads a one-query step's keys as a run per row (``flash-decode``)."""
    _loaded(name)
    return name in _READS_KEY_RANGE


def get_kernel(name: str) -> Kernel:
    _loaded(name)
    if name not in _KERNELS:
        raise one_of("attention kernel", name, _KERNELS)
    return _KERNELS[name]


def check_kernel(name: str) -> str:
    get_kernel(name)
    return name


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask | None = None, *,
           dropout_p: float = 0.0, scale: float | None = None, kernel: str = "sdpa") -> torch.Tensor:
    """Attend ``q: [B, h_q, T, d]`` (or a :class:`FactoredQuery`) over ``k, v: [B, h_kv, S, d]`` with
    the named kernel, under ``mask``, the finished :class:`~mhe.attention.masks.AttentionMask` of
    what each query may see (built in :mod:`mhe.attention.masks`; None: every key). A kernel that
    reads key ranges gets the mask's ``key_range`` (one contiguous run of keys per row) where it has
    one; the others get its dense form as they read it
    (:meth:`~mhe.attention.masks.AttentionMask.for_kernel`), or SDPA's ``is_causal`` for a causal
    mask with no dense form (as many keys as queries)."""
    fn = get_kernel(kernel)
    if isinstance(q, FactoredQuery) and not reads_factored_query(kernel):
        q = q.heads()
    if mask is None:
        return fn(q, k, v, mask=None, is_causal=False, dropout_p=dropout_p, scale=scale)
    if mask.key_range is not None:
        if not reads_key_range(kernel):
            raise MheError(f"key_range is read by the key-range kernels only (flash-decode, split-k-decode), "
                           f"not by {kernel!r}")
        return fn(q, k, v, mask=None, is_causal=False, dropout_p=dropout_p, scale=scale, key_range=mask.key_range)
    rows = q.shared if isinstance(q, FactoredQuery) else q
    dense = mask.for_kernel(kernel, rows.dtype)
    if dense is None and mask.causal and rows.shape[2] != k.shape[2]:
        raise MheError(f"a causal mask without a dense form reads as many keys as queries, got {q.shape[2]} queries "
                       f"over {k.shape[2]} keys; build the mask with mhe.attention.masks.self_attention_mask")
    return fn(q, k, v, mask=dense, is_causal=dense is None and mask.causal, dropout_p=dropout_p, scale=scale)


def _one_token_grouped(q, k, mask, dropout_p) -> bool:
    """One new token over a grouped cache, each query row under the same mask per batch row."""
    return (k.shape[1] != q.shape[1] and q.shape[2] == 1 and dropout_p == 0.0
            and (mask is None or mask.shape[1] == 1))


def _rows(q, k, mask):
    b, hq, _, d = q.shape
    hk = k.shape[1]
    rows = q.reshape(b, hk, hq // hk, d)  # [B, h_kv, group, d]: a group's heads as query rows
    if mask is not None:
        mask = mask.reshape(mask.shape[0], 1, 1, mask.shape[-1])  # [B|1, 1, 1, S]
    return rows, mask


# SDPA's backends that apply any dropout rate exactly: cuDNN's kernels resolve it only in steps
# of 1/16 (PyTorch pull request 174245, after which SDPA no longer routes other rates to cuDNN)
EXACT_DROPOUT_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
_TORCH = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
_BACKENDS_TRACEABLE = _TORCH >= (2, 6)


def exact_dropout_backends(device_type: str, dropout_p: float) -> list | None:
    """The SDPA backends a CUDA call with attention dropout ``dropout_p`` may use, or None for
    SDPA's own choice: a rate that is no multiple of 1/16 (the paper's 0.1) keeps the call off
    cuDNN, which would apply a rounded rate; torch releases that already refuse such rates on
    cuDNN choose the same backend either way. Dynamo traces the restriction from torch 2.6 on;
    a compiled call on an older torch keeps SDPA's own choice."""
    if not dropout_p or device_type != "cuda" or float(dropout_p * 16).is_integer():
        return None
    if not _BACKENDS_TRACEABLE and torch.compiler.is_compiling():
        return None
    return EXACT_DROPOUT_BACKENDS


GROUPED_GRAD_OFF_CUDNN = True
"""Whether :func:`grouped_grad_backends` keeps grouped training calls off cuDNN (the profile script
turns it off to measure the step both ways in one run; it never changes the function)."""


def grouped_grad_backends(device_type: str, *, grouped: bool, grad: bool, masked: bool, square: bool,
                          long_on_cudnn: bool = False) -> list | None:
    """The SDPA backends a CUDA call over grouped K/V heads (``h_kv < h_q``, ``enable_gqa``) that
    autograd records may use, or None for SDPA's own choice: off cuDNN, so on FlashAttention-2,
    which reads grouped heads natively and sums each group's dK/dV after computing them per
    query head (Dao 2023; PyTorch's ``mha_bwd``), as parallel as multi-head attention. Only where
    FlashAttention takes the call: no mask, and causal only over as many keys as queries
    (``square``); a masked call keeps SDPA's choice. Why: where SDPA prefers cuDNN for grouped
    heads (dropout 0), the grouped kinds' training step falls behind MHA's, while on
    FlashAttention it keeps up (docs/benchmarks.md section 7;
    ``benchmarks/train_bench.py profile --presets llama-135m`` times the step both ways). A call
    ``long_on_cudnn`` (:func:`cudnn_for_grad`) runs on cuDNN instead (:data:`CUDNN_GROUPED_BACKENDS`).
    Off with :data:`GROUPED_GRAD_OFF_CUDNN`."""
    if not (GROUPED_GRAD_OFF_CUDNN and device_type == "cuda" and grouped and grad and not masked and square):
        return None
    if not _BACKENDS_TRACEABLE and torch.compiler.is_compiling():
        return None
    return CUDNN_GROUPED_BACKENDS if long_on_cudnn else EXACT_DROPOUT_BACKENDS


def sdpa_backends(q, k, v, kw: dict, device_type: str | None = None) -> list | None:
    """The backends of :func:`_sdpa`'s call (``kw``: its keywords), or None for SDPA's choice;
    ``device_type`` (default q's) asks what the same call would get on another device."""
    dev = device_type or q.device.type
    return exact_dropout_backends(dev, kw.get("dropout_p", 0.0)) or grouped_grad_backends(
        dev, grouped=bool(kw.get("enable_gqa")) and k.shape[1] != q.shape[1],
        grad=torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        masked=kw.get("attn_mask") is not None, square=not kw.get("is_causal") or q.shape[2] == k.shape[2],
        long_on_cudnn=cudnn_for_grad(q, k, device_type=dev, cudnn=None if dev == q.device.type else False))


MEM_EFFICIENT_GQA = _TORCH >= (2, 14)
"""Whether CUDA's memory-efficient SDPA kernel reads grouped K/V heads (``enable_gqa``): from PyTorch
pull request 191085 (torch 2.14) on. Before it, FlashAttention-2 is the only fused CUDA backend that
admits them, and a grouped call it refuses (a mask, float32, head_dim over 256, causal over more keys
than queries) fell through to the math backend, which repeats K/V and writes out every score."""
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


def grouped_natively(q, k, kw: dict, device_type: str | None = None) -> bool:
    """Whether SDPA reads the grouped K/V heads (``h_kv < h_q``) of the call with keywords ``kw``
    natively on a fused backend: FlashAttention-2 (no mask, fp16/bf16, head_dim <= 256, causal only
    over as many keys as queries), the memory-efficient kernel from torch 2.14 on, or the CPU's
    fused kernel. Where not (:data:`MEM_EFFICIENT_GQA`), :func:`_sdpa` repeats K/V to the query
    heads first, so the call runs on the memory-efficient or cuDNN kernel instead of the math
    backend's quadratic memory. ``device_type`` (default q's) asks about another device."""
    if (device_type or q.device.type) != "cuda" or k.shape[1] == q.shape[1] or MEM_EFFICIENT_GQA:
        return True
    return (kw.get("attn_mask") is None and _sdpa_dtype(q) in _FLASH_DTYPES and q.shape[-1] <= 256
            and (not kw.get("is_causal") or q.shape[2] == k.shape[2]))


def _sdpa_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype SDPA computes ``q`` in: autocast's where it is on for CUDA (a float32 query, such
    as MHE-Mul's after its float32 head factors, is cast before the backend is chosen), else q's."""
    if q.dtype == torch.float32 and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return q.dtype


CUDNN_GRAD_MIN_KEYS = 2048
"""From this many keys on, an unmasked grouped call that autograd records on a Hopper card with
SDPA's cuDNN kernel runs on cuDNN, which reads the grouped K/V heads natively in the forward and
sums each group's dK/dV inside its backward (:func:`cudnn_for_grad`): nothing is repeated, so the
grouped kinds keep their memory, and the step skips the repetition's copies and the sums that
autograd would add over repeated heads (docs/benchmarks.md section 11). Shorter calls stay on
FlashAttention-2, which was the faster at 512 tokens (section 7)."""
CUDNN_GROUPED_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
"""The backends of such a call: cuDNN, or FlashAttention-2 (also native) where a torch's cuDNN
kernel refuses grouped heads, or the math backend where both are switched off (as the other
restrictions keep it), rather than no backend at all."""


def cudnn_for_grad(q, k, *, device_type: str | None = None, cudnn: bool | None = None) -> bool:
    """Whether a grouped call that autograd records is long enough to train on cuDNN over its
    grouped heads (:data:`CUDNN_GRAD_MIN_KEYS`); ``device_type`` and ``cudnn`` (default: q's
    device and whether it is a Hopper card with cuDNN attention on) ask about another card."""
    if (device_type or q.device.type) != "cuda" or k.shape[1] == q.shape[1] or k.shape[2] < CUDNN_GRAD_MIN_KEYS:
        return False
    if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)):
        return False
    return _cudnn_attention(q.device) if cudnn is None else cudnn


def _sdpa(q, k, v, **kw):
    """``F.scaled_dot_product_attention`` on the backends :func:`sdpa_backends` allows, over K/V
    heads repeated to the query heads where no fused backend reads them grouped (:func:`grouped_natively`)."""
    if kw.get("enable_gqa") and not grouped_natively(q, k, kw):
        n = q.shape[1]
        k, v, kw = _repeat_kv(k, n, copy=True), _repeat_kv(v, n, copy=True), {**kw, "enable_gqa": False}
    backends = sdpa_backends(q, k, v, kw)
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    with restrict_backends(backends):
        return F.scaled_dot_product_attention(q, k, v, **kw)


@register_kernel("sdpa", additive_mask=True)
def sdpa_kernel(q, k, v, *, mask, is_causal, dropout_p, scale):
    if _one_token_grouped(q, k, mask, dropout_p):
        rows, rmask = _rows(q, k, mask)
        out = F.scaled_dot_product_attention(rows, k, v, attn_mask=rmask, scale=scale)
        return out.reshape(q.shape)  # [B, h_q, 1, d]
    grouped = True if k.shape[1] != q.shape[1] else False  # noqa: SIM210  a bool, not a SymBool, under dynamic shapes
    return _sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale, enable_gqa=grouped)


@register_kernel("sdpa-expand", additive_mask=True)
def sdpa_expand_kernel(q, k, v, *, mask, is_causal, dropout_p, scale):
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])  # [B, h_q, S, d]
    if q.is_cuda and k.stride(1) == 0:  # an expanded head: not the memory-efficient kernel (below)
        with restrict_backends(EXPANDED_HEAD_BACKENDS):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p,
                                                  scale=scale)
    return _sdpa(q, k, v, attn_mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


EXPANDED_HEAD_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
"""What SDPA may run keys and values of stride 0 over the heads on: PyTorch's memory-efficient
kernel has returned wrong numbers for such inputs with a mask in bf16 (pytorch/pytorch issue
191937), so it is left out."""


@register_kernel("matmul-decode")
def matmul_decode_kernel(q, k, v, *, mask, is_causal, dropout_p, scale):
    if not _one_token_grouped(q, k, mask, dropout_p):
        return sdpa_kernel(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    rows, rmask = _rows(q, k, mask)
    sc = rows @ k.transpose(-2, -1)  # [B, h_kv, group, S]
    sc = sc.to(torch.promote_types(sc.dtype, torch.float32)) * (scale or 1.0 / math.sqrt(q.shape[-1]))
    if rmask is not None:
        sc = sc.masked_fill(~rmask, float("-inf"))
    return (sc.softmax(-1).to(v.dtype) @ v).reshape(q.shape)  # [B, h_q, 1, d]


@register_kernel("eager")
def eager_kernel(q, k, v, *, mask, is_causal, dropout_p, scale):
    """The softmax written out."""
    if is_causal:  # SDPA's is_causal: query i sees keys 0 .. i
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()[None, None]
    probs = _probabilities(q, k, mask, scale)
    if dropout_p > 0:
        probs = F.dropout(probs, p=dropout_p)
    return probs @ _repeat_kv(v, q.shape[1])  # [B, h_q, T, d]


@register_kernel("eager-one-token")
def eager_one_token_kernel(q, k, v, *, mask, is_causal, dropout_p, scale):
    """``eager`` for a one-token query (a decode step), ``sdpa`` for longer ones."""
    fn = eager_kernel if q.shape[2] == 1 else sdpa_kernel
    return fn(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)


def _probabilities(q, k, mask, scale):
    k = _repeat_kv(k, q.shape[1])
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # [B, h, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1)


def _repeat_kv(t: torch.Tensor, n_q: int, *, copy: bool = False) -> torch.Tensor:
    """``t: [B, h, S, d]`` with each head repeated for its ``n_q // h`` query heads. One head
    outside autograd (a decode step reading its cache) is expanded without a copy (stride 0)
    unless ``copy`` (the memory-efficient kernel has returned wrong numbers for such heads under a
    mask, :data:`EXPANDED_HEAD_BACKENDS`); training keeps the copy, whose backward SDPA's kernels
    have always been given."""
    h = t.shape[1]
    if h == n_q:
        return t
    if h == 1 and not t.requires_grad and not copy:
        return t.expand(-1, n_q, -1, -1)
    return t.repeat_interleave(n_q // h, dim=1)


# --- the decode kernel policy: which kernel a one-token step runs ---------------------------------
EXPAND_MAX_POSITIONS = 1024
"""The longest cache a one-row decode of a one-K/V-head model reads through ``sdpa-expand``; longer
caches keep ``flash-decode``'s split over the keys, which spreads one row's work over the card
(the crossover is measured in docs/benchmarks.md section 9)."""


def decode_kernel(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None,
                  requested: str | None = None, *, batch: int | None = None, positions: int | None = None) -> str:
    """The kernel ``module``'s attention sublayers decode one-token steps with: the generation
    policy, for ``generate`` and beam search alike.

    ``requested`` when given (the caller chose). Else, on CUDA, for sublayers configured with the
    default ``sdpa``: ``eager-one-token`` in fp32 (SDPA has no fast fp32 one-query kernel,
    docs/benchmarks.md section 6); where every cache holds one K/V head (MQA, SHA, fast MHE),
    ``sdpa-expand`` for one row of at most :data:`EXPAND_MAX_POSITIONS` cache ``positions`` on a
    card with SDPA's cuDNN kernel (the head expanded without a copy: one cuDNN kernel a layer, as
    MHA gets, where FlashAttention's split-K step launches two; docs/benchmarks.md section 9) and
    ``flash-decode`` otherwise (split-K FlashAttention over the keys, ``attention/flash_decode.py``).
    With Triton installed, every cache with fewer K/V heads than query heads (MQA, SHA, fast MHE,
    GQA) decodes with ``split-k-decode`` (``attention/triton_decode.py``: a group's query heads in
    one tile, the keys split across the card), in fp32 and at batch 1 too: llama-135m's step at
    one row of 512 positions took 0.72 ms through it for MHE-Mul against 0.91 through
    ``sdpa-expand``, and GQA's 0.88 against 1.13 through SDPA over grouped rows, where cuDNN picks
    a 64-row tile for 3 rows (docs/benchmarks.md, "Kernels a layer"). A cache of as many K/V heads
    as query heads takes it at batch 1 in fp16 and bf16: cuDNN runs one row's heads as a few
    128-query tiles (MHA on llama-135m, one H200: 220 us a token against the kernel's 136; 0.824-0.828
    against 0.745 ms a token through ``generate``, docs/benchmarks.md, "MHA at batch 1"; SKV,
    EL-att and MHE-Mul psi-then-rope, whose caches have MHA's shape, follow unmeasured); at more
    rows cuDNN's kernel, which reads such a cache near the copy bandwidth, is kept.
    Else the configured kernel, which a model configured with another kernel keeps. ``dtype``:
    the decoding dtype (default: the weights').
    """
    from mhe.attention import triton_decode  # a plugin (PLUGINS), loaded only where decoding is chosen

    if requested is not None:
        return requested
    attns = _sublayers(module)
    configured = attns[0].cfg.kernel if attns else "sdpa"
    if torch.device(device).type != "cuda" or any(a.cfg.kernel != "sdpa" for a in attns):
        return configured
    fp32 = (dtype or next(module.parameters()).dtype) == torch.float32
    one_short_row = batch == 1 and positions is not None and positions <= EXPAND_MAX_POSITIONS
    cached = [a for a in attns if a.supports_cache]
    one_head = all(a.cache_heads == 1 for a in cached)
    fewer_kv = all(a.cache_heads < a.cfg.n_heads or a.cache_heads == 1 for a in cached)
    half = (dtype or next(module.parameters()).dtype) in (torch.float16, torch.bfloat16)
    if triton_decode.available() and cached and (fewer_kv or (batch == 1 and half)):
        return "split-k-decode"
    if fp32:
        return "eager-one-token"
    if one_head:
        return "sdpa-expand" if one_short_row and _cudnn_attention(device) else "flash-decode"
    return configured


MASK_FORMS = ("dense", "key-range")
"""How a decode step's mask reaches the kernel: ``dense`` (a boolean mask, or SDPA's causal flag),
which every kernel reads, or ``key-range`` (one run of keys per row, built once per forward for
one causal query), which only the kernels registered with ``reads_key_range`` read."""


@dataclass(frozen=True)
class DecodePlan:
    """The decode choice of one decoding run: the kernel every attention sublayer it reaches runs
    and the form of the mask the model builds for it.

    A decode session makes one (:func:`decode_plan`) and passes it down the call
    (``model(..., plan=plan)``, every block, every sublayer's ``forward``), so no sublayer's
    configuration carries the decode choice and no two layers of one step can run different
    kernels or read different masks. Without a plan a model runs its configured kernel
    (``AttentionConfig.kernel``) over dense masks. A plan never changes results, only how they
    are computed.

    Attributes:
        kernel: a name in :data:`KERNELS`.
        mask_form: one of :data:`MASK_FORMS`; ``key-range`` only for a kernel that reads ranges.
    """

    kernel: str
    mask_form: str = "dense"

    def __post_init__(self) -> None:
        check_kernel(self.kernel)
        if self.mask_form not in MASK_FORMS:
            raise one_of("decode mask form", self.mask_form, MASK_FORMS)
        if self.mask_form == "key-range" and not reads_key_range(self.kernel):
            raise MheError(f"kernel {self.kernel!r} reads no key ranges; its decode mask form is 'dense'")

    @classmethod
    def of(cls, kernel: str, *, dense: bool = False) -> DecodePlan:
        """The plan of ``kernel`` with the mask form it reads fastest (key ranges where it reads
        them), or ``dense`` (beam search: its masks read a window of the cache)."""
        return cls(kernel, "key-range" if not dense and reads_key_range(kernel) else "dense")

    @property
    def key_range(self) -> bool:
        """Whether the model builds a run of keys per row for one causal query."""
        return self.mask_form == "key-range"


def decode_plan(module: nn.Module, device: torch.device | str, dtype: torch.dtype | None = None,
                requested: str | None = None, *, batch: int | None = None, positions: int | None = None,
                dense: bool = False) -> DecodePlan:
    """The :class:`DecodePlan` of :func:`decode_kernel`'s kernel for ``module`` (same arguments;
    ``dense``: see :meth:`DecodePlan.of`). The one place a session's decode choice is made."""
    kernel = decode_kernel(module, device, dtype, requested, batch=batch, positions=positions)
    return DecodePlan.of(kernel, dense=dense)


@torch.compiler.assume_constant_result
def _cudnn_attention(device: torch.device | str) -> bool:
    """SDPA's cuDNN kernel is on and ``device`` is a Hopper card or later (sm90, where ``sdpa-expand``
    takes it). Inside ``torch.compile`` it is evaluated once while tracing and kept as a constant:
    dynamo cannot trace ``cudnn_sdp_enabled`` (a torch function returning a bool), and the graph
    break it made at every grouped training call of a compiled step (:func:`cudnn_for_grad`) cost
    more than the kernel saved (docs/benchmarks.md section 11)."""
    device = torch.device(device)
    return (device.type == "cuda" and torch.backends.cuda.cudnn_sdp_enabled()
            and torch.cuda.get_device_capability(device) >= (9, 0))


def split_kernel(kernel: str) -> tuple[str, str | None]:
    """A kernel option that may be ``auto`` (``mhe bench --kernel``) -> (the model's configured
    kernel, the decode kernel asked for; None = the automatic choice of :func:`decode_kernel`)."""
    return ("sdpa", None) if kernel == "auto" else (kernel, kernel)


def view_kernels(module: nn.Module) -> str:
    """The kernels ``module``'s attention sublayers are configured with, e.g. ``sdpa`` (for reports;
    a decoding run's kernel is its plan's, :attr:`DecodePlan.kernel`)."""
    return ",".join(sorted({a.cfg.kernel for a in _sublayers(module)})) or "-"


def _sublayers(module: nn.Module) -> list:
    from mhe.attention.base import attention_sublayers  # base imports this module

    return attention_sublayers(module)
