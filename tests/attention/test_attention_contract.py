"""Contract tests run over the whole registry: a new kind gets them for free."""

import pytest
import torch

from conftest import B, D_MODEL, N_HEADS, T
from mhe.accounting import attention_params, count_params
from mhe.attention import KINDS, CrossCache, attention_class, build_attention
from mhe.errors import MheError
from reference import reference_forward

CAUSAL_KINDS = [k for k in KINDS if k != "fnet"]
CACHE_KINDS = [k for k in KINDS if attention_class(k).supports_cache]
CROSS_KINDS = [k for k in KINDS if attention_class(k).supports_cross]


def make(kind, **kw):
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    if kind == "linear":
        opts["max_len"] = 16
    opts.update(kw)
    mod = build_attention(kind, d_model=D_MODEL, n_heads=N_HEADS, **opts).double()
    with torch.no_grad():  # non-trivial values everywhere, biases and head embeddings included
        for p in mod.parameters():
            p.normal_(0, 0.3)
    return mod.eval()


def x64(*shape):
    return torch.randn(*shape, dtype=torch.float64)


@pytest.mark.parametrize("kind", KINDS)
def test_shape_and_reference(kind):
    causal = kind != "fnet"
    mod = make(kind, causal=causal, bias=True)
    x = x64(B, T, D_MODEL)
    out = mod(x)
    assert out.shape == (B, T, D_MODEL)
    torch.testing.assert_close(out, reference_forward(mod, x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_mask_matches_reference(kind):
    mod = make(kind, causal=False)
    x = x64(B, T, D_MODEL)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    mask[1, 3:] = False
    torch.testing.assert_close(mod(x, mask=mask), reference_forward(mod, x, mask=mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", CROSS_KINDS)
def test_cross_attention_matches_reference(kind):
    mod = make(kind, causal=True)  # causal is ignored for cross-attention
    x, ctx = x64(B, T, D_MODEL), x64(B, 5, D_MODEL)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])
    out = mod(x, context=ctx, mask=mask)
    torch.testing.assert_close(out, reference_forward(mod, x, context=ctx, mask=mask), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", CAUSAL_KINDS)
def test_causal_future_does_not_leak(kind):
    mod = make(kind, causal=True)
    x = x64(B, T, D_MODEL)
    y = x.clone()
    y[:, 4:] = x64(B, T - 4, D_MODEL)
    a, b = mod(x), mod(y)
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


@pytest.mark.parametrize("kind", KINDS)
def test_padded_keys_do_not_matter(kind):
    mod = make(kind, causal=False)
    x = x64(B, T, D_MODEL)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[:, 5:] = False
    y = x.clone()
    y[:, 5:] = x64(B, 2, D_MODEL)
    torch.testing.assert_close(mod(x, mask=mask)[:, :5], mod(y, mask=mask)[:, :5], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_cached_decoding_equals_full_forward(kind):
    mod = make(kind, causal=True)
    x = x64(B, T, D_MODEL)
    full = mod(x)
    cache = mod.new_cache(B, T + 3)
    steps = [mod(x[:, :3], cache=cache)]  # a prompt, then one token at a time
    steps += [mod(x[:, t:t + 1], cache=cache) for t in range(3, T)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    assert int(cache.index) == T


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_cross_attention_cache(kind):
    mod = make(kind)
    x, ctx = x64(B, T, D_MODEL), x64(B, 5, D_MODEL)
    cache = CrossCache()  # the encoder's keys and values, stored at the first step
    steps = [mod(x[:, t:t + 1], context=ctx, cache=cache) for t in range(T)]
    torch.testing.assert_close(torch.cat(steps, 1), mod(x, context=ctx), rtol=1e-10, atol=1e-10)


def test_cache_heads_per_kind():
    sizes = {k: make(k).new_cache(1, 8).k.shape[1] for k in CACHE_KINDS}
    assert sizes == {"mha": 4, "sha": 1, "mqa": 1, "gqa": 2, "skv": 4, "el-att": 4, "mhe-add": 1, "mhe-mul": 1}
    assert make("mhe-mul", impl="reference").new_cache(1, 8).k.shape[1] == 4


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in CACHE_KINDS])
def test_mixing_kinds_refuse_cache_and_context(kind):
    mod = make(kind)
    with pytest.raises(MheError, match="no KV cache"):
        mod.new_cache(1, 8)
    with pytest.raises(MheError, match="cannot cross-attend"):
        mod(x64(B, T, D_MODEL), context=x64(B, 3, D_MODEL))


def test_fnet_refuses_causal():
    with pytest.raises(MheError, match="cannot be causal"):
        build_attention("fnet", d_model=32, n_heads=4, causal=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bias", [False, True])
def test_param_count_equals_formula(kind, bias):
    mod = make(kind, bias=bias)
    opts = {"n_kv_heads": 2} if kind == "gqa" else ({"max_len": 16} if kind == "linear" else {})
    for include_output in (True, False):
        assert count_params(mod, include_output=include_output) == attention_params(
            kind, d_model=D_MODEL, n_heads=N_HEADS, include_output=include_output, bias=bias, **opts)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip(kind):
    a, b = make(kind), make(kind)
    b.load_state_dict(a.state_dict())
    x = x64(B, T, D_MODEL)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)


def test_parameter_names_are_the_checkpoint_format():
    names = {k: sorted(n for n, _ in make(k).named_parameters()) for k in KINDS}
    assert names["mha"] == ["k_proj.weight", "out_proj.weight", "q_proj.weight", "v_proj.weight"]
    assert names["skv"] == ["kv_proj.weight", "out_proj.weight", "q_proj.weight"]
    assert names["el-att"] == ["out_proj.weight", "q_proj.weight"]
    assert names["mhe-mul"] == ["head_embed", "k_proj.weight", "out_proj.weight", "q_proj.weight", "v_proj.weight"]
    assert make("mhe-add").head_embed.shape == (3, N_HEADS, D_MODEL // N_HEADS)


@pytest.mark.parametrize("bad, match", [
    (dict(kind="nope"), "unknown attention kind 'nope'; valid: mha, sha"),
    (dict(kind="mha", d_model=30, n_heads=4), "d_model=30 is not divisible by n_heads=4"),
    (dict(kind="mha", d_model=0, n_heads=4), "d_model must be a positive integer, got 0"),
    (dict(kind="mha", d_model=32, n_heads=-1), "n_heads must be a positive integer, got -1"),
    (dict(kind="gqa", d_model=32, n_heads=4, n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
    (dict(kind="mhe-mul", d_model=32, n_heads=4, impl="slow"), "unknown MHE impl 'slow'; valid: fast, reference"),
    (dict(kind="mha", d_model=32, n_heads=4, n_kv_heads=2), "takes no option 'n_kv_heads'"),
    (dict(kind="el-att", d_model=32, n_heads=4, head_dim=4), "n_heads\\*head_dim must equal d_model"),
    (dict(kind="mha", d_model=32, n_heads=4, dropout=1.5), "dropout must be in \\[0, 1\\)"),
])
def test_bad_configuration_is_named(bad, match):
    kw = dict(d_model=32, n_heads=4) | bad
    kind = kw.pop("kind")
    with pytest.raises(MheError, match=match):
        build_attention(kind, **kw)


def test_bad_mask_and_input_are_named():
    mod = make("mha")
    x = x64(B, T, D_MODEL)
    with pytest.raises(MheError, match=r"mask must be a boolean key-padding mask of shape \[B=2, S=7\]"):
        mod(x, mask=torch.ones(B, T + 1, dtype=torch.bool))
    with pytest.raises(MheError, match="mask must be a boolean"):
        mod(x, mask=torch.ones(B, T))
    with pytest.raises(MheError, match=r"input must have shape \[B, T, d_model=32\]"):
        mod(x64(B, T, 16))


def test_cache_overflow_is_named():
    mod = make("mqa", causal=True)
    cache = mod.new_cache(B, 4)
    with pytest.raises(MheError, match="KV cache overflow"):
        mod(x64(B, 5, D_MODEL), cache=cache)


KERNELS = ("sdpa", "sdpa-expand", "eager", "matmul-decode", "eager-one-token", "split-k-decode")


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_every_kernel_matches_reference_and_cached_decoding(kind, kernel):
    """Every kind with every kernel: causal and masked forwards against tests/reference.py,
    and cached decoding with a key-padding mask against the masked full forward."""
    mod = make(kind, causal=True, bias=True, kernel=kernel)
    x = x64(B, T, D_MODEL)
    torch.testing.assert_close(mod(x), reference_forward(mod, x), rtol=1e-10, atol=1e-10)
    plain = make(kind, causal=False, kernel=kernel)
    plain.load_state_dict(make(kind, causal=False).state_dict())
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :2] = False
    torch.testing.assert_close(plain(x, mask=mask), reference_forward(plain, x, mask=mask), rtol=1e-10, atol=1e-10)
    full = mod(x, mask=mask)
    cache = mod.new_cache(B, T + 2)
    cache_mask = torch.ones(B, T + 2, dtype=torch.bool)
    cache_mask[:, :T] = mask
    steps = [mod(x[:, :3], mask=cache_mask, cache=cache)]
    steps += [mod(x[:, t:t + 1], mask=cache_mask, cache=cache) for t in range(3, T)]
    torch.testing.assert_close(torch.cat(steps, 1)[0], full[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(torch.cat(steps, 1)[1, 2:], full[1, 2:], rtol=1e-10, atol=1e-10)


def test_sdpa_expand_reads_one_head_without_a_copy_outside_autograd():
    """A decode step's one K/V head is expanded (stride 0) for SDPA, not copied; the numbers are
    sdpa's own, and with autograd the copy (and its backward) is kept."""
    from mhe.attention.kernels import _repeat_kv, get_kernel

    q, k, v = x64(B, 4, 1, 8), x64(B, 1, 6, 8), x64(B, 1, 6, 8)
    mask = torch.ones(B, 1, 1, 6, dtype=torch.bool)
    mask[0, ..., :2] = False
    additive = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
    with torch.no_grad():
        view = _repeat_kv(k, 4)
        assert view.stride(1) == 0 and view.data_ptr() == k.data_ptr()
        args = dict(mask=additive, is_causal=False, dropout_p=0.0, scale=None)
        torch.testing.assert_close(get_kernel("sdpa-expand")(q, k, v, **args), get_kernel("sdpa")(q, k, v, **args),
                                   rtol=1e-12, atol=1e-12)
    assert _repeat_kv(k.requires_grad_(), 4).stride(1) != 0


def test_unknown_kernel_is_named():
    with pytest.raises(MheError, match="unknown attention kernel 'flash3'; valid: sdpa"):
        build_attention("mha", d_model=32, n_heads=4, kernel="flash3")


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_cached_decoding_with_padding_equals_masked_full_forward(kind):
    """Logits-level: one token at a time over a cache, with keys masked out in the middle of
    the cache, equals the masked full forward (catches decoding that drops the mask)."""
    mod = make(kind, causal=True)
    x = x64(B, T, D_MODEL)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 1] = mask[1, 3] = mask[1, 4] = False
    full = mod(x, mask=mask)
    cache = mod.new_cache(B, T)
    steps = [mod(x[:, t:t + 1], mask=mask[:, :t + 1], cache=cache) for t in range(T)]
    real = mask.clone()  # padding queries attend to themselves only; compare the real ones
    torch.testing.assert_close(torch.cat(steps, 1)[real], full[real], rtol=1e-10, atol=1e-10)
    assert not torch.allclose(full[real], mod(x)[real])  # the mask matters


def test_kernels_take_the_finished_mask_and_refuse_a_causal_one_they_cannot_place():
    """Every mask is built in mhe.attention.masks; attend reads the AttentionMask it is given."""
    from mhe.attention import kernels, masks
    from mhe.attention.masks import AttentionMask

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64) for _ in range(3))
    tril = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    for kernel in ("sdpa", "eager"):
        by_flag = kernels.attend(q, k, v, AttentionMask(causal=True), kernel=kernel)
        by_dense = kernels.attend(q, k, v, AttentionMask(dense=tril), kernel=kernel)
        built = kernels.attend(q, k, v, masks.self_attention_mask(q[:, 0], None), kernel=kernel)
        torch.testing.assert_close(by_flag, by_dense, rtol=0, atol=1e-12)
        torch.testing.assert_close(built, by_dense, rtol=0, atol=1e-12)
        assert not torch.allclose(kernels.attend(q, k, v, None, kernel=kernel), by_dense)  # None: every key
    with pytest.raises(MheError, match="2 queries over 5 keys"):
        kernels.attend(q[:, :, :2], k, v, AttentionMask(causal=True))
