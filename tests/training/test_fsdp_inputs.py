"""What every transformer block receives survives FSDP2's handling of a sharded module's inputs.

On a GPU, FSDP2 passes each sharded block's positional and keyword inputs through
``torch.distributed.utils._apply_to_tensors`` before the block runs: to move them to the device
and to cast floating-point tensors to the mixed-precision policy's ``param_dtype``. That function
rebuilds every dataclass it meets with ``dataclasses.replace``, so an input type that cannot be
rebuilt (a field declared ``init=False``, as the attention mask once had) fails the first GPU step
of every sharded run, while CPU runs, which cast nothing, never take that path.

Here each block's inputs go through the same function with a dtype-casting function (a forward
pre-hook returns what it made, as FSDP's does), for every architecture and attention kind that
trains, with padding and, for decoders, cached steps: the outputs must equal the unhooked
model's exactly, and the hook must really have seen a mask.
"""

import functools

import pytest
import torch
from torch.distributed.utils import _apply_to_tensors

from mhe.attention.masks import AttentionMask
from mhe.attention.registry import KINDS
from mhe.errors import MheError
from mhe.models import build_model
from mhe.training.activation_checkpointing import transformer_blocks

ARCHS = ("tiny-decoder", "llama-tiny", "tiny-encoder", "tiny-encoder-decoder")
ROPE_ORDERS = ("rope-then-psi", "psi-then-rope")


def _cases():
    for arch in ARCHS:
        for kind in KINDS:
            orders = ROPE_ORDERS if arch == "llama-tiny" and kind.startswith("mhe-") else (None,)
            for order in orders:
                yield pytest.param(arch, kind, order, id=f"{arch}-{kind}" + (f"-{order}" if order else ""))


def _build(arch: str, kind: str, order: str | None, dtype: torch.dtype):
    options = {"rope_order": order} if order else {}
    try:
        model = build_model(arch, attention=kind, dropout=0.0, attn_dropout=0.0,
                            **({"attn_options": options} if options else {}))
    except MheError:  # a kind this architecture refuses (fnet in a decoder, linear under rotary, ...)
        return None
    torch.manual_seed(0)
    for p in model.parameters():  # away from the initialisation, so head embeddings matter
        p.data.add_(0.05 * torch.randn_like(p))
    return model.to(dtype).eval()


def _cast(dtype: torch.dtype, t: torch.Tensor) -> torch.Tensor:
    return t.to(dtype) if torch.is_floating_point(t) else t


def _hook_blocks(model, dtype: torch.dtype) -> tuple[list, list]:
    """Forward pre-hooks that hand every block its inputs rebuilt as FSDP2 rebuilds them."""
    seen: list = []

    def rebuild(module, args, kwargs):
        cast = functools.partial(_cast, dtype)
        args, kwargs = _apply_to_tensors(cast, args), _apply_to_tensors(cast, kwargs)
        seen.append(kwargs)
        return args, kwargs

    handles = [b.register_forward_pre_hook(rebuild, with_kwargs=True) for b in transformer_blocks(model)]
    return handles, seen


def _outputs(arch: str, model) -> list[torch.Tensor]:
    """The model's outputs on a padded batch (and, for decoders, two cached steps after it)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 1000, (2, 7), generator=g)
    pad = torch.ones(2, 7, dtype=torch.long)
    if arch == "tiny-encoder-decoder":
        tgt = torch.randint(5, 1000, (2, 5), generator=g)
        pad[1, 5:] = 0  # right padding of the source
        return [model(ids, tgt, src_mask=pad, tgt_mask=torch.ones(2, 5, dtype=torch.long)).logits]
    if arch == "tiny-encoder":
        pad[1, 5:] = 0
        return [model(ids, attention_mask=pad).logits]
    pad[1, :2] = 0  # left padding, as generation pads
    outs = [model(ids, attention_mask=pad).logits]
    try:
        caches = model.new_caches(2, 16, dtype=next(model.parameters()).dtype)
    except MheError:  # token mixing (linear) has no cache
        return outs
    outs.append(model(ids, attention_mask=pad, caches=caches).logits)
    for _ in range(2):
        nxt = torch.randint(5, 1000, (2, 1), generator=g)
        full = torch.cat([pad, torch.ones(2, 1, dtype=torch.long)], 1)
        outs.append(model(nxt, attention_mask=full, caches=caches).logits)
        pad = full
    return outs


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bf16"])
@pytest.mark.parametrize("arch,kind,order", list(_cases()))
def test_block_inputs_rebuilt_as_fsdp_casts_them_give_the_same_outputs(arch, kind, order, dtype):
    model = _build(arch, kind, order, dtype)
    if model is None:
        pytest.skip(f"{arch} does not build {kind}")
    with torch.no_grad():
        want = _outputs(arch, model)
        handles, seen = _hook_blocks(model, dtype)
        try:
            got = _outputs(arch, model)
        finally:
            for h in handles:
                h.remove()
    assert seen and any(isinstance(v, AttentionMask) for kw in seen for v in kw.values())
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert torch.equal(g, w)


def test_a_mask_rebuilt_with_dataclasses_replace_keeps_every_field_and_a_cache_of_its_own():
    dense = torch.tensor([[True, False, True]])[:, None, None, :]
    mask = AttentionMask(keys=3, dense=dense, padding=dense[:, 0, 0])
    first = mask.for_kernel("sdpa", torch.float32)
    rebuilt = _apply_to_tensors(functools.partial(_cast, torch.bfloat16), mask)
    assert rebuilt is not mask and rebuilt == mask  # keys, dense, causal, key_range, padding carried over
    assert rebuilt._additive == {}  # the additive form is made again for the copy, in the dtype asked
    assert torch.equal(rebuilt.for_kernel("sdpa", torch.bfloat16), first.to(torch.bfloat16))
