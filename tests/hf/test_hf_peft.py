"""LoRA through peft on exported models (:mod:`mhe.hf.remote`) and on ``mhe.hf`` models.

The projection names documented in docs/transformers.md ("LoRA with peft") are the targets: a LoRA step
changes only the adapter weights, the adapters change the model's output, and the merged model
(``merge_and_unload``) computes what the model with adapters computes.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from mhe.hf import to_hf, to_remote  # noqa: E402
from mhe.models import build_model  # noqa: E402
from weights_kept import perturb  # noqa: E402

SMALL = dict(vocab_size=61, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_len=24)
EXPORTED = ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out", "gate", "up", "down"]
MHE_HF = {"mha": ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out", "gate", "up", "down"],
          "mhe-mul": ["k_proj", "v_proj", "fc_in", "fc_out", "gate", "up", "down"]}


def _lora_step(model, targets):
    """One AdamW step on a LoRA-wrapped ``model``; returns (peft model, base weights before)."""
    x = torch.randint(7, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    before = {k: v.clone() for k, v in wrapped.named_parameters() if "lora_" not in k}
    opt = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2)
    wrapped.train()
    wrapped(input_ids=x, labels=x).loss.backward()
    opt.step()
    return wrapped.eval(), before, x


def _check(wrapped, before, x, base_logits):
    """Only adapter weights moved; the adapters act; merged equals unmerged."""
    after = dict(wrapped.named_parameters())
    assert all(torch.equal(after[k], v) for k, v in before.items())
    lora = [k for k, p in after.items() if p.requires_grad]
    assert lora and all("lora_" in k for k in lora)
    with torch.no_grad():
        unmerged = wrapped(input_ids=x).logits
        assert (unmerged - base_logits).abs().max() > 1e-6  # the adapters are in the path
        merged = wrapped.merge_and_unload()(input_ids=x).logits
    torch.testing.assert_close(merged, unmerged, rtol=0, atol=1e-12)


@pytest.mark.parametrize("preset, kind", [("llama-tiny", "mhe-mul"), ("tiny-decoder", "mhe-mul"),
                                          ("tiny-decoder", "mhe-add"), ("llama-tiny", "gqa")])
def test_lora_on_exported_model(preset, kind):
    model = to_remote(perturb(build_model(preset, attention=kind, **SMALL).double()))
    targets = [t for t in EXPORTED if any(n.endswith("." + t) for n, _ in model.named_modules())]
    x = torch.randint(7, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model.eval()(x).logits
    _check(*_lora_step(model, targets), base)


@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
def test_lora_on_mhe_hf_model(kind):
    """``mhe.hf`` models: MHE's fast path folds the head embeddings into the query and output
    weights, so its adapters go on the key, value and feed-forward projections."""
    model = to_hf(perturb(build_model("tiny-decoder", attention=kind, **SMALL).double()))
    targets = [t for t in MHE_HF[kind] if any(n.endswith("." + t) for n, _ in model.named_modules())]
    x = torch.randint(7, 61, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model.eval()(x).logits
    _check(*_lora_step(model, targets), base)
