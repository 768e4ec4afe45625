"""Padding changes nothing for the real tokens, in every attention path.

Every kind of the registry, causal and bidirectional, without and with a KV cache (a padded
prompt into the cache, then one token at a time, as generation runs it), self- and
cross-attention, under every kernel of :data:`mhe.attention.kernels.KERNELS` that runs on a
CPU: each row's real tokens in a padded batch, its padding filled with large random values,
give the outputs the row gives alone, unpadded, under the same kernel, in float64 to 1e-12.
A kernel or mask that lets one padded key through fails here, whichever path it is on.

The token-mixing kinds have no keys: Linear mixes by absolute position, so only right padding
(the real tokens keep their positions) leaves them alone, and FNet's Fourier transform runs over
the padded length itself, so its outputs depend on the length (padded values do not:
``test_attention_contract.test_padded_keys_do_not_matter``).
"""

from __future__ import annotations

import pytest
import torch

from mhe.attention import KINDS, CrossCache, attention_class, build_attention, masks
from mhe.attention.kernels import KERNELS, DecodePlan

D, H, LENGTHS, NEW = 16, 4, (5, 2, 4), 3  # model width, heads, real prompt lengths, decoded tokens
TOL = dict(rtol=1e-12, atol=1e-12)
CACHE_KINDS = [k for k in KINDS if attention_class(k).supports_cache]
CROSS_KINDS = [k for k in KINDS if attention_class(k).supports_cross]


def _runs_on_cpu(kernel: str) -> bool:
    try:
        _module("mha", causal=True, kernel=kernel)(torch.randn(1, 2, D, dtype=torch.float64))
    except Exception:  # noqa: BLE001  a GPU-only kernel: left to the GPU suite
        return False
    return True


def _module(kind: str, *, causal: bool, kernel: str = "sdpa"):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {"max_len": 16} if kind == "linear" else {}
    mod = build_attention(kind, d_model=D, n_heads=H, causal=causal, kernel=kernel, bias=True, **opts).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.normal_(0, 0.3)
    return mod.eval()


CPU_KERNELS = [k for k in KERNELS if _runs_on_cpu(k)]


def _padded(rows: list[torch.Tensor], side: str):
    """``[B, T, D]`` with every row padded (large random values) to the longest, and the mask."""
    width = max(r.shape[0] for r in rows)
    x = torch.randn(len(rows), width, D, dtype=torch.float64) * 100
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        span = slice(width - r.shape[0], width) if side == "left" else slice(0, r.shape[0])
        x[i, span], mask[i, span] = r, True
    return x, mask


def _rows(lengths=LENGTHS):
    return [torch.randn(n, D, dtype=torch.float64) for n in lengths]


def _forward(mod, x, mask, causal):
    m = masks.self_attention_mask(x, mask, causal=True) if causal else masks.padding_mask(mask)
    return mod(x, mask=m)


def _sides(kind):
    return ["right"] if attention_class(kind).supports_cache is False else ["left", "right"]


CASES = [(k, c, kern, side) for k in KINDS for c in (True, False) for kern in CPU_KERNELS for side in _sides(k)
         if not (k == "fnet") and not (c and k == "fnet")]


@pytest.mark.parametrize("kind, causal, kernel, side", CASES)
def test_uncached_padding_changes_no_real_token(kind, causal, kernel, side):
    mod = _module(kind, causal=causal, kernel=kernel)
    rows = _rows()
    x, mask = _padded(rows, side)
    with torch.no_grad():
        out = _forward(mod, x, mask, causal)
        for i, r in enumerate(rows):
            alone = _forward(mod, r[None], None, causal)[0]
            torch.testing.assert_close(out[i][mask[i]], alone, **TOL)


def _decode(mod, x, mask, causal, steps: torch.Tensor, kernel: str):
    """Prefill ``x`` (``mask``: its real tokens) into a fresh cache, then decode ``steps``
    ``[B, NEW, D]`` one token at a time; the outputs of the new tokens ``[B, NEW, D]``."""
    b, t, _ = x.shape
    length = t + steps.shape[1]
    cache = mod.new_cache(b, length)
    m = masks.self_attention_mask(x, mask, causal=causal, keys=length, plan=DecodePlan.of(kernel))
    mod(x, mask=m, cache=cache)
    seen, outs = mask, []
    for j in range(steps.shape[1]):
        tok = steps[:, j:j + 1]
        seen = torch.cat([seen, torch.ones(b, 1, dtype=torch.bool)], 1) if seen is not None else None
        m = masks.self_attention_mask(tok, seen, causal=causal, start=cache.index, keys=length,
                                      plan=DecodePlan.of(kernel))
        outs.append(mod(tok, mask=m, cache=cache))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("kind, causal, kernel", [(k, c, kern) for k in CACHE_KINDS for c in (True, False)
                                                  for kern in CPU_KERNELS])
def test_cached_decoding_after_a_left_padded_prompt_changes_no_real_token(kind, causal, kernel):
    mod = _module(kind, causal=causal, kernel=kernel)
    rows = _rows()
    x, mask = _padded(rows, "left")
    steps = torch.randn(len(rows), NEW, D, dtype=torch.float64)
    with torch.no_grad():
        out = _decode(mod, x, mask, causal, steps, kernel)
        for i, r in enumerate(rows):
            alone = _decode(mod, r[None], None, causal, steps[i:i + 1], kernel)[0]
            torch.testing.assert_close(out[i], alone, **TOL)


@pytest.mark.parametrize("kind, cached, kernel", [(k, c, kern) for k in CROSS_KINDS for c in (False, True)
                                                  for kern in CPU_KERNELS])
def test_cross_attention_over_a_padded_source_changes_nothing(kind, cached, kernel):
    mod = _module(kind, causal=True, kernel=kernel)
    sources = _rows()
    ctx, mask = _padded(sources, "right")
    queries = torch.randn(len(sources), NEW, D, dtype=torch.float64)

    def run(q, c, m):
        if not cached:
            return mod(q, context=c, mask=masks.padding_mask(m))
        cache = CrossCache()  # the source's keys stored at the first step, read by the next ones
        return torch.cat([mod(q[:, j:j + 1], context=c, mask=masks.padding_mask(m), cache=cache)
                          for j in range(q.shape[1])], 1)

    with torch.no_grad():
        out = run(queries, ctx, mask)
        for i, s in enumerate(sources):
            torch.testing.assert_close(out[i], run(queries[i:i + 1], s[None], None)[0], **TOL)


def test_every_kernel_on_a_cpu_is_covered():
    """The kernels above are the registry's, less those that cannot run on a CPU."""
    assert {"sdpa", "sdpa-expand", "eager", "matmul-decode", "eager-one-token"} <= set(CPU_KERNELS)
