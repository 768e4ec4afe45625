"""GPU checks of the rotating step (``mhe.attention.rotary_step``, ``kv_cache.ROTARY_STEP``; run
with ``pytest -m gpu``): the kernel against the rotary embedding and ``torch.stack`` in fp32 and
bf16, and ``model.generate``'s compiled, captured step through it against the same step without
it (fp32 logits to 1e-5, the same greedy tokens) for ragged left-padded prompts."""

import pytest
import torch

from mhe.attention import kv_cache, rotary_step
from mhe.attention.rotary import RotaryEmbedding
from mhe.models import build_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(rotary_step.triton is None, reason="needs Triton")]


@pytest.mark.parametrize("kind,opts", [("mha", {}), ("gqa", {"n_kv_heads": 2}), ("mhe-mul", {})])
def test_compiled_generation_through_the_kernel_equals_the_unfused_step(kind, opts, monkeypatch):
    torch.manual_seed(0)
    model = build_model("llama-tiny", attention=kind, attn_options=opts or None).cuda().float().eval()
    ids = torch.randint(3, 1024, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", False)  # the unfused step, whatever the default
    want, lw = model.generate(ids, 16, attention_mask=mask, session=model.generator(3, 30, step_mode="compile"),
                              return_logits=True)
    launches, launch = [], rotary_step.launch_step
    monkeypatch.setattr(rotary_step, "launch_step", lambda *a: launches.append(1) or launch(*a))
    monkeypatch.setattr(kv_cache, "ROTARY_STEP", True)
    torch._dynamo.reset()
    got, lg = model.generate(ids, 16, attention_mask=mask, session=model.generator(3, 30, step_mode="compile"),
                             return_logits=True)
    assert launches  # the compiled step's operator launched the kernel
    torch.testing.assert_close(lg, lw, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_the_step_kernel_rotates_what_the_embedding_rotates(dtype, tol):
    torch.manual_seed(0)
    b, n, g, d = 4, 9, 3, 64
    rotary = RotaryEmbedding(d, max_len=128).cuda()
    qkv = torch.randn(b, 1, (n + 2 * g) * d, device="cuda", dtype=dtype)
    q, k, v = rotary_step.split_product(qkv, n, g)
    positions = torch.tensor([[3], [0], [100], [41]], device="cuda")
    assert rotary_step.step_fast_path(qkv, n, g, positions)
    got_q, got_kv = rotary_step.rotate_step(qkv, n, g, rotary, positions)
    torch.testing.assert_close(got_q.float(), rotary(q, positions).float(), rtol=tol, atol=tol)
    want_kv = torch.stack((rotary(k, positions), v))
    torch.testing.assert_close(got_kv.float(), want_kv.float(), rtol=tol, atol=tol)
    assert torch.equal(got_kv[1], v)
