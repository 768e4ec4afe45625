"""The ``split-k-decode`` kernel: one new query per row over a cache with fewer K/V heads than
query heads (or as many: groups of one, MHA at batch 1), each K/V byte read once per step, the
keys split across the card.

A decode step of MQA, folded MHE, MHE under rotary positions (its per-head factors already on
the query, one shared K/V head) or GQA reads a cache ``k, v: [B, h_kv, S, d]`` with
``h_q = G * h_kv`` query heads. Memory, not arithmetic, bounds it: the bytes are
``2 * B * h_kv * S * d`` elements per layer (paper-notes, "bytes a decode step must read"), so
the kernel must (1) read each K/V element once, with the G query heads that share a K/V head
(query heads ``h*G .. h*G + G - 1`` read K/V head ``h``) packed as the rows of one tile, and
(2) keep every SM streaming, which one program per (row, K/V head) does not at small
``B * h_kv``: the keys of each row are split into ``splits`` chunks, one program each
("flash-decoding", Dao, Haziza, Massa and Sizov 2023), each writing its partial output
(normalised over its chunk) and log-sum-exp, and the last program of each (row, K/V head) to
finish merges the group's chunks (the softmax of a union is the log-sum-exp-weighted mean of the
softmaxes of its parts): one launch a layer. A second small merge kernel does it instead where no
counter buffer can be had (:func:`launch`).

Row ``b`` sees one contiguous run of cache positions ``[start_b, start_b + used_b)``: left
padding before it, positions not yet written after it. The model hands the run as
``key_range = (cum_seq_k [B + 1], used [B], ...)`` (:func:`mhe.attention.masks.decode_key_range`,
``cum_seq_k[b] = b * S + start_b``), the format ``flash-decode`` reads; the kernel recovers
``start_b`` itself, so a layer launches nothing but its kernel. A boolean ``[B|1, 1, 1, S]``
mask holding one run per row is read as that run (:func:`mhe.attention.flash_decode.mask_range`).
Each program splits its row's *used* run evenly, so early steps of a long buffer stay balanced;
``splits`` itself depends only on static shapes and the card, so a step is the same CUDA graph
for every token. Inside ``torch.compile`` the launch is one opaque operator
(``mhe::split_k_decode``, with a fake implementation for tracing), which inductor leaves as it is.

Numbers: scores and the softmax in float32 (float64 for float64 input), the probabilities cast to
the values' dtype for the second product as FlashAttention does; float32 products run in IEEE
float32 (no TF32). Triton is optional: without it, on a CPU tensor (outside Triton's interpreter,
``TRITON_INTERPRET=1``, which the tests use), on a card older than Ampere, with dropout, several
query tokens, a mask that is no run per row, or autograd recording, the kernel runs ``sdpa``
unchanged.
"""

from __future__ import annotations

import functools
import math
import os
import struct

import torch

from mhe.attention.flash_decode import _flash_capable, key_offsets, mask_range, range_mask
from mhe.attention.kernels import FactoredQuery, register_kernel, sdpa_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # a machine without Triton decodes through sdpa
    triton = tl = None

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
"""The widest head the kernels take (a wider one, SHA's, runs ``sdpa``)."""
MAX_SPLITS = 128
"""The most chunks one row's keys are split into (the merge holds them all in registers)."""
PROGRAMS_PER_SM = 2
"""Split programs aimed at per SM: two, each streaming a longer chunk three tiles deep, kept an
H200's memory busier than four shorter ones (``benchmarks/decode.py split-k --sweep``,
docs/benchmarks.md section 12)."""
MIN_SPLIT_KEYS = 128
"""The fewest cache positions a chunk is given: one loop step of :data:`TILE` (a program's fixed
work is loading its queries and writing its partial output)."""
MERGE_TILE = 16384
"""The most partial-output elements (chunks x head width) one merge program holds in registers."""
FUSED_MERGE_TILE = 8192
"""The most partial-output elements (query heads x chunks x head width, each padded to a power of
two) a split program merges in one load: above it the merge kernel runs. One H200 (docs/benchmarks.md
section 12): the fused merge of 64 rows (4 chunks a row) took the one-K/V-head layer from 72% to
73% of the copy bandwidth (llama-135m) and from 63% to 65% (llama-1.1b); a last program that
walked 32 chunks of one row (batch 1) in steps made llama-135m's step 0.1 ms slower than the
merge kernel's 9 programs in parallel."""
TILE = {"block_n": 128, "num_warps": 4, "num_stages": 3}
"""The split kernel's launch: cache positions per loop step (fewer where a K tile would pass
:data:`TILE_BYTES`), warps, and software-pipelining stages (``benchmarks/decode.py split-k --sweep``
times others)."""
TILE_BYTES = 16384
"""The most bytes of one K (or V) tile: with three stages of K and V, 96 KiB of shared memory (a
Hopper SM has 227 KiB; float32 heads of 128 at 128 positions would need 384 KiB). bf16 heads of
64 take 128 positions, of 128 take 64, float32 heads of 128 take 32."""


def available() -> bool:
    """Whether Triton is importable here."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton's interpreter runs the kernels (``TRITON_INTERPRET=1``: CPU tensors, tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_merge_group_jit = _queries_jit = None
""":func:`_merge_group` and :func:`_queries` compiled, set with the kernels (:func:`_jitted`): the split
kernel calls them."""


def _split_kernel(Q, F, K, V, CUM_K, USED, OUT, PART_O, PART_LSE, COUNT, scale_hi, scale_lo, S, H_KV, SPLITS,
                  sqb, sqh, skb, skh, sks, svb, svh, svs, sob, soh,
                  G: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr, FUSED: tl.constexpr, FACTORS: tl.constexpr,
                  BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                  ACC: tl.constexpr):
    """One chunk of one row's keys for the G query heads of one K/V head: its partial output
    (normalised within the chunk) and log-sum-exp, or, with one chunk, the output itself. With
    ``FUSED``, the group's last program to finish merges the group's chunks (see :func:`launch`).
    ``FACTORS``: the heads made from one shared query (:func:`_queries`)."""
    split = tl.program_id(0)
    b = (tl.program_id(1) // H_KV).to(tl.int64)  # int64: a large cache's offsets pass 2**31
    h = (tl.program_id(1) % H_KV).to(tl.int64)
    start = tl.load(CUM_K + b) - b * S
    used = tl.load(USED + b)
    chunk = ((used + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N  # a multiple of BLOCK_N
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, start + used)
    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = h * G + g  # the query heads that read K/V head h
    gmask = g < G
    dmask = dd < D
    q = _queries_jit(Q + b * sqb, F, heads, dd, gmask[:, None] & dmask[None, :], sqh, D, FACTORS, ACC)
    scale = tl.zeros([BLOCK_G], dtype=ACC) + scale_hi + scale_lo  # the scale in the accumulator's precision
    m_i = tl.zeros([BLOCK_G], dtype=ACC) - float("inf")
    l_i = tl.zeros([BLOCK_G], dtype=ACC)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=ACC)
    k_row = K + b * skb + h * skh
    v_row = V + b * svb + h * svh
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + n
        nmask = pos < hi
        k = tl.load(k_row + pos[:, None] * sks + dd[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee", out_dtype=ACC) * scale[:, None]  # [BLOCK_G, BLOCK_N]
        s = tl.where(nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_row + pos[:, None] * svs + dd[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee", out_dtype=ACC)
        m_i = m_new
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # an empty chunk: zeros
    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:  # one chunk: the output itself
        tl.store(OUT + b * sob + heads[:, None] * soh + dd[None, :], out.to(OUT.dtype.element_ty), mask=omask)
    else:
        row = (b * H_KV * G + heads) * SPLITS + split  # [BLOCK_G]: (b, query head, split)
        tl.store(PART_O + row[:, None] * D + dd[None, :], out, mask=omask)
        tl.store(PART_LSE + row, m_i + tl.log(l_i), mask=gmask)  # -inf for an empty chunk
        if FUSED:
            # every thread's stores first, then one release-acquire count of the group's finished chunks
            tl.debug_barrier()
            finished = tl.atomic_add(COUNT + b * H_KV + h, 1, sem="acq_rel", scope="gpu")
            if finished == SPLITS - 1:  # the last chunk: the others' partials are visible
                tl.atomic_xchg(COUNT + b * H_KV + h, 0, sem="relaxed", scope="gpu")  # ready for the next launch
                _merge_group_jit(PART_O, PART_LSE, OUT + b * sob, (b * H_KV + h) * G * SPLITS, SPLITS, soh, heads,
                                 G, D, BLOCK_G, BLOCK_D, BLOCK_S, ACC)


def _queries(Q_ROW, F, heads, dd, qmask, sqh, D: tl.constexpr, FACTORS: tl.constexpr, ACC: tl.constexpr):
    """A group's query heads ``[BLOCK_G, BLOCK_D]`` as loaded, or, with ``FACTORS`` (1: multiply,
    2: add), made from the row's one shared query (``sqh`` 0) and the heads' rows of ``F``, each
    rounded to the query's dtype as the unfused product is (kernels.FactoredQuery)."""
    q = tl.load(Q_ROW + heads[:, None] * sqh + dd[None, :], mask=qmask, other=0.0)
    if FACTORS != 0:
        f = tl.load(F + heads[:, None] * D + dd[None, :], mask=qmask, other=0.0)
        if FACTORS == 1:
            q = (q.to(ACC) * f.to(ACC)).to(Q_ROW.dtype.element_ty)
        else:
            q = (q.to(ACC) + f.to(ACC)).to(Q_ROW.dtype.element_ty)
    return q


def _merge_group(PART_O, PART_LSE, OUT_ROW, first, SPLITS, soh, heads, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ACC: tl.constexpr):
    """The fused merge: the G query heads of one group, their partials from row ``first`` on,
    laid out (head, chunk), loaded as one tile and each chunk's output weighted by exp(lse_s -
    the log-sum-exp of all). Loads go past the SM's own cache (``.cg``): other SMs wrote them."""
    g = tl.arange(0, BLOCK_G)
    dd = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    part = (g < G)[:, None] & (s < SPLITS)[None, :]  # [BLOCK_G, BLOCK_S]
    prow = first + g[:, None] * SPLITS + s[None, :]
    lse = tl.load(PART_LSE + prow, mask=part, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)  # every chunk empty: weights 0, output 0
    w = tl.exp(lse - top[:, None])
    o = tl.load(PART_O + prow[:, :, None] * D + dd[None, None, :], mask=part[:, :, None] & (dd < D)[None, None, :],
                other=0.0, cache_modifier=".cg")  # [BLOCK_G, BLOCK_S, BLOCK_D]
    den = tl.sum(w, 1)
    merged = tl.sum(w[:, :, None] * o, 1) / tl.where(den == 0, 1.0, den)[:, None]
    tl.store(OUT_ROW + heads[:, None] * soh + dd[None, :], merged.to(OUT_ROW.dtype.element_ty),
             mask=(g < G)[:, None] & (dd < D)[None, :])

def _merge_kernel(PART_O, PART_LSE, OUT, H_Q, SPLITS, sob, soh,
                  D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One query head of one row: its chunks' outputs weighted by exp(lse_s - log-sum-exp of all)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H_Q
    hq = bh % H_Q
    s = tl.arange(0, BLOCK_S)
    dd = tl.arange(0, BLOCK_D)
    smask = s < SPLITS
    lse = tl.load(PART_LSE + bh * SPLITS + s, mask=smask, other=float("-inf"))  # [BLOCK_S]
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every chunk empty: weights 0, output 0
    w = tl.exp(lse - top)
    den = tl.sum(w, 0)
    o = tl.load(PART_O + (bh * SPLITS + s)[:, None] * D + dd[None, :], mask=smask[:, None] & (dd < D)[None, :],
                other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den == 0, 1.0, den)
    tl.store(OUT + b * sob + hq * soh + dd, out.to(OUT.dtype.element_ty), mask=dd < D)


@functools.cache
def _jitted(interpret: bool):
    """The two kernels compiled by Triton (or run by its interpreter): built at the first launch,
    so ``TRITON_INTERPRET`` set by then decides."""
    del interpret  # part of the cache key only: triton.jit reads the environment itself
    globals()["_merge_group_jit"] = triton.jit(_merge_group)  # the split kernel calls them by these names
    globals()["_queries_jit"] = triton.jit(_queries)
    return triton.jit(_split_kernel), triton.jit(_merge_kernel)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, groups: int) -> torch.Tensor | None:
    """A zeroed int32 counter per (row, K/V head) for the fused merge, kept per device and reused
    by every launch there: each launch leaves its counters at zero, and launches on one device's
    stream run in order. Made (or grown) outside CUDA-graph capture only; inside a capture
    without one large enough (a step captured without running first), None: the merge kernel
    runs instead. Launches on one device from two streams at once must not share it: decoding
    runs on one stream."""
    buf = _COUNTERS.get(device)
    if buf is not None and buf.numel() >= groups:
        return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    _COUNTERS[device] = buf = torch.zeros(max(groups, 1024), dtype=torch.int32, device=device)
    return buf


def choose_splits(programs: int, keys: int, sms: int) -> int:
    """How many chunks each row's ``keys`` positions are split into, for ``programs`` (row, K/V
    head) pairs on a card of ``sms`` SMs: at most :data:`PROGRAMS_PER_SM` programs per SM, so
    that they run in one wave (one more program than fit would double the step: each program
    streams its whole chunk), at least :data:`MIN_SPLIT_KEYS` positions a chunk, at most
    :data:`MAX_SPLITS` chunks."""
    want = PROGRAMS_PER_SM * sms // programs
    return max(1, min(want, -(-keys // MIN_SPLIT_KEYS), MAX_SPLITS))


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cum_k: torch.Tensor, used: torch.Tensor,
           scale: float, splits: int | None = None, fused: bool | None = None,
           factors: torch.Tensor | None = None, add: bool = False) -> torch.Tensor:
    """The kernels on ``q: [B, h_q, 1, d]``, ``k, v: [B, h_kv, S, d]`` (any strides; a last one
    other than 1 is copied first), ``cum_k: [B + 1]`` and ``used: [B]`` int32; returns ``[B, h_q, 1, d]``.
    ``splits``: chunks per row (default :func:`choose_splits`). ``factors``: ``[h_q, d]`` in q's
    dtype, with ``q: [B, 1, 1, d]`` one shared query a row (a :class:`~mhe.attention.kernels.FactoredQuery`):
    head i is ``q * factors[i]`` (``add``: ``q + factors[i]``), made as the kernel loads it.

    ``fused`` (default: where the group's partials fit :data:`FUSED_MERGE_TILE`), where there are
    chunks to merge and :func:`_counters` has a counter buffer: one launch, not two.
    Each split program, once its partial output is written, adds one to its group's counter
    (release-acquire, at GPU scope); the program that brings it to ``splits`` sees every other
    chunk's partials, merges them, writes the output and sets the counter back to zero. The
    merge kernel's launch, and its start and end, are what a step of few K/V bytes cannot hide
    (docs/benchmarks.md section 12). ``fused=False`` launches the separate merge kernel.

    The kernels launch on the tensors' card, whichever card is current (Triton launches on the
    current one: a model on cuda:1 decoding eagerly while cuda:0 is current)."""
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        with torch.cuda.device(q.device):
            return _launch(q, k, v, cum_k, used, scale, splits, fused, factors, add)
    return _launch(q, k, v, cum_k, used, scale, splits, fused, factors, add)


def _launch(q, k, v, cum_k, used, scale, splits, fused, factors=None, add=False) -> torch.Tensor:
    """:func:`launch` on the current card."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernels step d by 1
    b, hq, _, d = q.shape
    if factors is not None:
        factors, hq = factors.contiguous(), factors.shape[0]
    hk, s = k.shape[1], k.shape[2]
    g = hq // hk
    sms = 8 if q.device.type == "cpu" else _sm_count(q.device.index or 0)
    block_d = max(16, _next_pow2(d))
    splits = min(splits or choose_splits(b * hk, s, sms), max(1, MERGE_TILE // block_d))
    out = torch.empty(b, hq, 1, d, dtype=q.dtype, device=q.device)
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    part_o = torch.empty(b * hq * splits, d, dtype=acc_dtype, device=q.device) if splits > 1 else out
    part_lse = torch.empty(b * hq * splits, dtype=acc_dtype, device=q.device) if splits > 1 else out
    block_n = min(TILE["block_n"], max(16, TILE_BYTES // (block_d * k.element_size())))
    block_g, block_s = max(16, _next_pow2(g)), max(2, _next_pow2(splits))
    if fused is None:
        fused = block_g * block_s * block_d <= FUSED_MERGE_TILE
    count = _counters(q.device, b * hk) if fused and splits > 1 else None
    fused = count is not None
    scale_hi = struct.unpack("f", struct.pack("f", scale))[0]  # float arguments reach Triton as float32
    split_kernel, merge_kernel = _jitted(interpreting())
    split_kernel[(splits, b * hk)](
        q, q if factors is None else factors, k, v, cum_k, used, out, part_o, part_lse, count if fused else used,
        scale_hi, scale - scale_hi, s, hk, splits, q.stride(0), 0 if factors is not None else q.stride(1),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
        G=g, D=d, DIRECT=splits == 1, FUSED=fused, FACTORS=0 if factors is None else 2 if add else 1,
        BLOCK_G=block_g, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_S=block_s,
        ACC=tl.float64 if acc_dtype == torch.float64 else tl.float32, num_warps=TILE["num_warps"],
        num_stages=TILE["num_stages"])
    if splits > 1 and not fused:
        merge_kernel[(b * hq,)](part_o, part_lse, out, hq, splits, out.stride(0), out.stride(1),
                                D=d, BLOCK_S=max(2, _next_pow2(splits)), BLOCK_D=block_d,
                                num_warps=4)
    return out


@torch.library.custom_op("mhe::split_k_decode", mutates_args=())
def split_k_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cum_k: torch.Tensor, used: torch.Tensor,
                   scale: float, factors: torch.Tensor | None = None, add: bool = False) -> torch.Tensor:
    """:func:`launch` as one operator that ``torch.compile`` traces without looking inside."""
    return launch(q, k, v, cum_k, used, scale, factors=factors, add=add)


@split_k_decode.register_fake
def _(q, k, v, cum_k, used, scale, factors=None, add=False):
    return q.new_empty(q.shape[0], q.shape[1] if factors is None else factors.shape[0], 1, q.shape[3])


def fast_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              dropout_p: float, heads: int | None = None) -> bool:
    """Whether ``split-k-decode`` runs its Triton kernels (else ``sdpa``); ``heads``: the query
    heads where ``q`` is one shared query (a factored one), default ``q.shape[1]``."""
    heads = q.shape[1] if heads is None else heads
    here = (q.is_cuda and q.dtype in DTYPES and _flash_capable(q.device.index or 0)) or (
        q.device.type == "cpu" and interpreting())  # Ampere or newer (the products' bf16 tensor cores)
    return (triton is not None and here and k.dtype == q.dtype and v.dtype == q.dtype
            and q.shape[2] == 1 and heads % k.shape[1] == 0 and q.shape[-1] <= MAX_HEAD_DIM
            and not is_causal and dropout_p == 0.0
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
            and (mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                                  and mask.shape[1] == 1 and mask.shape[2] == 1)))


FACTORS_IN_KERNEL = True
"""Whether the kernel applies a :class:`~mhe.attention.kernels.FactoredQuery`'s factors itself (else
the heads are made first, by inductor's kernel inside a compiled step: the unfused path, which
the tests compare it with)."""


@register_kernel("split-k-decode", reads_key_range=True, reads_factored_query=True)
def split_k_decode_kernel(q, k, v, *, mask, is_causal, dropout_p, scale, key_range=None):
    """``key_range``: ``(cum_seq_k [B + 1], used [B], ...)`` int32 in place of ``mask`` (see the
    module docstring); ``mask``, when given, must allow one run of keys per row. ``q`` may be a
    :class:`~mhe.attention.kernels.FactoredQuery`, applied inside the kernel (:data:`FACTORS_IN_KERNEL`)."""
    s = k.shape[2]
    factors, add = None, False
    if isinstance(q, FactoredQuery):
        if FACTORS_IN_KERNEL and q.factors.dtype == q.shared.dtype and \
                fast_path(q.shared, k, v, mask, is_causal, dropout_p, heads=q.factors.shape[0]):
            q, factors, add = q.shared, q.factors, q.add
        else:
            q = q.heads()
    if factors is None and not fast_path(q, k, v, mask, is_causal, dropout_p):
        if key_range is not None:
            mask = range_mask(key_range, s)
        return sdpa_kernel(q, k, v, mask=mask, is_causal=is_causal, dropout_p=dropout_p, scale=scale)
    if key_range is None:
        start, used = mask_range(mask, q.shape[0], s, device=q.device)
        key_range = key_offsets(start, s), used
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if torch.compiler.is_compiling():  # one opaque operator in the traced graph
        return split_k_decode(q, k, v, key_range[0], key_range[1], scale, factors, add)
    return launch(q, k, v, key_range[0], key_range[1], scale, factors=factors, add=add)  # eager: no dispatch
