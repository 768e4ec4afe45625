"""The training step's kernels, changed for speed, compute what they computed before: the chunked
cross-entropy bit for bit, BERT's default token type, attention kept off cuDNN where it would round
the dropout rate; and the profile reader sorts kernels as it says."""

import pytest
import torch
import torch.nn.functional as F

from conftest import B, D_MODEL, N_HEADS, T, VOCAB
from mhe.attention import build_attention, kernels
from mhe.bench.profiling import kernel_category, sdpa_calls
from mhe.models.losses import IGNORE, linear_cross_entropy


def _in_place_chunked_loss(hidden, weight, bias, target, divisor, vocab, eps, rows, dtype):
    """The chunked loss and its gradients as first written: the padding filled with -inf in place,
    the target's -(1 - eps) scatter-added (the oracle of the fused rewrite)."""
    acc = torch.promote_types(dtype, torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):
        w, b = weight.to(dtype), None if bias is None else bias.to(acc)
        total, gh = hidden.new_zeros((), dtype=acc), torch.empty_like(hidden)
        gw = torch.zeros_like(weight, dtype=acc)
        gb = None if bias is None else torch.zeros_like(bias, dtype=acc)
        for s in range(0, hidden.shape[0], rows):
            h, y = hidden[s:s + rows].to(dtype), target[s:s + rows]
            z = (h @ w.t()).to(acc)
            if b is not None:
                z = z + b
            z[:, vocab:] = float("-inf")
            lse = z.logsumexp(-1)
            keep = y != IGNORE
            safe = torch.where(keep, y, 0)[:, None]
            row = lse - (1 - eps) * z.gather(1, safe).squeeze(1)
            if eps:
                row = row - eps * z[:, :vocab].sum(-1) / vocab
            total = total + torch.where(keep, row, 0).sum()
            g = (z - lse[:, None]).exp_()
            g.scatter_add_(1, safe, torch.full_like(safe, eps - 1, dtype=acc))
            if eps:
                g[:, :vocab] -= eps / vocab
            g = (g * (keep.to(acc) / divisor)[:, None]).to(dtype)
            gh[s:s + rows] = (g @ w).to(hidden.dtype)
            gw.add_(g.t() @ h)
            if gb is not None:
                gb.add_(g.sum(0))
    return total / divisor, gh, gw, gb


@pytest.mark.parametrize("precision", ["float64", "float32", "bf16"])
@pytest.mark.parametrize("eps,bias", [(0.0, False), (0.1, True)])
def test_fused_chunked_loss_is_bit_identical_to_the_in_place_one(precision, eps, bias):
    g = torch.Generator().manual_seed(7)
    dt = torch.float64 if precision == "float64" else torch.float32
    h = torch.randn(B * T, D_MODEL, generator=g, dtype=dt, requires_grad=True)
    w = torch.randn(128, D_MODEL, generator=g, dtype=dt)
    w[VOCAB:] = 0
    w.requires_grad_()
    b = torch.randn(128, generator=g, dtype=dt).requires_grad_() if bias else None
    y = torch.randint(0, VOCAB, (B * T,), generator=g)
    y[3] = IGNORE
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss = linear_cross_entropy(h, w, b, y, vocab_size=VOCAB, label_smoothing=eps, chunk_rows=4)
        dtype = torch.bfloat16 if precision == "bf16" else dt
        want = _in_place_chunked_loss(h.detach(), w.detach(), None if b is None else b.detach(), y,
                                      (y != IGNORE).sum(), VOCAB, eps, 4, dtype)
    got = (loss, *torch.autograd.grad(loss, [h, w] + ([b] if bias else [])))
    for x, ref in zip(got, want):
        assert torch.equal(x, ref.to(x.dtype))


def test_default_token_type_is_row_zero_of_the_type_embedding():
    from mhe.models import build_model

    model = build_model("tiny-encoder", vocab_size=VOCAB, d_model=D_MODEL, n_heads=N_HEADS, n_layers=1, d_ff=64,
                        dropout=0.0, attn_dropout=0.0).double()
    ids = torch.randint(0, VOCAB, (B, T))
    zeros = torch.zeros_like(ids)
    embed = model.encoder.embed
    assert torch.equal(embed(ids), embed(ids, token_types=zeros))  # same sums, bit for bit
    g_default = torch.autograd.grad(model(ids).logits.sum(), embed.types.weight)[0]
    g_zeros = torch.autograd.grad(model(ids, token_type_ids=zeros).logits.sum(), embed.types.weight)[0]
    torch.testing.assert_close(g_default, g_zeros, rtol=1e-12, atol=1e-12)
    assert not g_default[1:].any()


def test_dropout_rates_cudnn_would_round_stay_off_cudnn():
    exact = kernels.EXACT_DROPOUT_BACKENDS
    assert torch.nn.attention.SDPBackend.CUDNN_ATTENTION not in exact
    assert kernels.exact_dropout_backends("cuda", 0.1) is exact  # the paper's rate: not a multiple of 1/16
    for device, p in (("cuda", 0.0), ("cuda", 0.125), ("cuda", 0.5), ("cpu", 0.1)):
        assert kernels.exact_dropout_backends(device, p) is None  # SDPA's own choice


def test_restricted_attention_computes_the_same_and_compiles_in_one_graph(monkeypatch):
    """Forcing the restriction on a CPU (where it changes no backend): the same output under the
    same seed, and dynamo traces the backend context without a graph break."""
    mod = build_attention("mha", d_model=D_MODEL, n_heads=N_HEADS, dropout=0.1).train()
    x = torch.randn(B, T, D_MODEL)
    torch.manual_seed(1)
    free = mod(x)
    monkeypatch.setattr(kernels, "exact_dropout_backends", lambda device, p: kernels.EXACT_DROPOUT_BACKENDS)
    torch.manual_seed(1)
    assert torch.equal(mod(x), free)
    explained = torch._dynamo.explain(mod)(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("name,category", [
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>, true>", "attention fwd"),
    ("flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "attention bwd"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_1", "attention bwd"),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention fwd"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul/GEMM"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopB_TNT", "matmul/GEMM"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor<float, 4>>", "optimizer"),
    ("triton_red_fused__to_copy_add_arange_logsumexp_masked_fill_1", "cross-entropy/loss"),
    ("triton_poi_fused__to_copy_arange_div_eq_exp_gather_ge_masked_fill_mul_where_2", "cross-entropy/loss"),
    ("triton_per_fused_add_native_dropout_native_layer_norm_3", "layernorm"),
    ("triton_poi_fused_gelu_inductor_random_mul_4", "dropout/RNG"),
    ("triton_poi_fused__to_copy_t_5", "copies/casts"),
    ("Memcpy HtoD (Pinned -> Device)", "copies/casts"),
    ("triton_poi_fused_add_gelu_6", "other elementwise/fused"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("ncclKernel_ReduceScatter_RING_LL_Sum_bfloat16", "communication"),
])
def test_kernel_categories(name, category):
    assert kernel_category(name) == category


def test_sdpa_backend_is_read_from_the_profile():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        q = torch.randn(B, N_HEADS, T, 8, requires_grad=True)
        F.scaled_dot_product_attention(q, q, q).sum().backward()
    assert sdpa_calls(prof, 1) == "flash 1 fwd / 1 bwd"  # the CPU flash kernel, forward and backward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_attention_with_the_papers_dropout_is_not_on_cudnn():
    mod = build_attention("mha", d_model=768, n_heads=12, causal=False, dropout=0.1).cuda().train()
    x = torch.randn(2, 512, 768, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.profiler.profile() as prof:
        mod(x).sum().backward()
    assert "cudnn" not in sdpa_calls(prof, 1)


def test_sdpa_backend_of_a_graph_replay_is_read_from_its_kernels():
    """A step replayed as CUDA graphs records no aten operators: the report names the backend from
    the attention kernels' own names (one forward and one backward kernel per call), not
    "decomposed into matrix products"."""
    from types import SimpleNamespace

    cuda, cpu = SimpleNamespace(name="CUDA"), SimpleNamespace(name="CPU")
    events = [SimpleNamespace(key="void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", count=24,
                              device_type=cuda),
              SimpleNamespace(key="void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<x>", count=24,
                              device_type=cuda),
              SimpleNamespace(key="void pytorch_flash::flash_bwd_convert_dq_kernel<x>", count=24, device_type=cuda),
              SimpleNamespace(key="void pytorch_flash::flash_bwd_dot_do_o_kernel<x>", count=24, device_type=cuda),
              SimpleNamespace(key="nvjet_sm90_tst_256x128", count=100, device_type=cuda),
              SimpleNamespace(key="cudaGraphLaunch", count=2, device_type=cpu)]
    prof = SimpleNamespace(key_averages=lambda: events)
    assert sdpa_calls(prof, 2) == "flash 12 fwd / 12 bwd (kernels of a CUDA-graph replay)"
    assert sdpa_calls(SimpleNamespace(key_averages=lambda: events[4:]), 2) == "none (decomposed into matrix products)"
