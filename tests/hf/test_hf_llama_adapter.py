"""The Hugging Face adapter (``mhe.hf.to_hf``, the Auto classes, ``generate``, ``Trainer``) with the
Llama-style decoder: rotary positions survive saving and loading (the cos/sin table is rebuilt, not
read from the meta device), the static cache holds the kind's K/V heads, and a Trainer step runs."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import mhe.hf  # noqa: E402  (registers the Auto classes)
from mhe.hf import from_hf, to_hf  # noqa: E402
from mhe.hf.modeling import CACHE_FIELD  # noqa: E402
from mhe.models import build_model  # noqa: E402
from weights_kept import perturb  # noqa: E402

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=32)


def core(kind="mhe-mul", **opts):
    return perturb(build_model("llama-tiny", attention=kind, attn_options=opts or None, **SMALL)).eval()


@pytest.mark.parametrize("kind, opts", [("mhe-mul", {}), ("gqa", {"n_kv_heads": 2})])
def test_saved_and_loaded_through_the_auto_class(kind, opts, tmp_path):
    m = core(kind, **opts)
    hf = to_hf(m)
    assert from_hf(hf) is m
    ids = torch.randint(3, 99, (2, 7))
    want = hf(ids).logits
    hf.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    saved = hf.state_dict()
    assert all(torch.equal(t, saved[k]) for k, t in loaded.state_dict().items())
    torch.testing.assert_close(loaded(ids).logits, want, rtol=0, atol=0)
    assert from_hf(loaded).cfg.positions == "rotary"


@pytest.mark.parametrize("kind, opts, heads", [("mhe-mul", {}, 1), ("gqa", {"n_kv_heads": 2}, 2),
                                               ("mhe-mul", {"rope_order": "psi-then-rope"}, 4)])
def test_static_cache_generation_keeps_the_kinds_heads(kind, opts, heads):
    """In float64 (``generate`` hands back its logits in float32: compared to float32 rounding).
    transformers' loop (the adapter's fall-through) with its static cache, and the fast path's
    session caches, hold the kind's K/V heads; both give ``model.generate``'s tokens."""
    m = core(kind, **opts).double()
    hf = to_hf(m).eval()
    ids = torch.randint(3, 99, (2, 5))
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    fast = hf.generate(ids, cache_implementation="static", **kw)
    assert mhe.generation.session._DEFAULT[m][-1].caches[0].k.shape[1] == heads
    hf.use_mhe_generate = False
    dyn = hf.generate(ids, **kw)
    sta = hf.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dyn.sequences, sta.sequences) and torch.equal(dyn.sequences, m.generate(ids, 6))
    assert torch.equal(fast.sequences, sta.sequences)
    torch.testing.assert_close(torch.stack(sta.logits), torch.stack(dyn.logits), rtol=1e-6, atol=1e-5)
    cache = getattr(sta, CACHE_FIELD)
    assert type(cache).__name__ == "StaticCache" and cache.layers[0].keys.shape[1] == heads
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), ids[1:, :3]], 1)  # row 1's first 3 tokens, left-padded
    batch = torch.cat([ids[:1], padded])
    out = hf.generate(batch, attention_mask=(batch != 0).long(), cache_implementation="static", **kw)
    alone = hf.generate(ids[1:, :3], **kw)
    torch.testing.assert_close(torch.stack(out.logits)[:, 1], torch.stack(alone.logits)[:, 0], rtol=1e-6, atol=1e-5)


class _Rows(torch.utils.data.Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.ids[i]}


def test_trainer_steps_the_llama_decoder(tmp_path):
    hf = to_hf(core())
    before = {k: v.clone() for k, v in hf.state_dict().items()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=1e-2, report_to=[], save_strategy="no", use_cpu=True, seed=0,
                                          logging_strategy="no", optim="sgd")
    result = transformers.Trainer(model=hf.train(), args=args, train_dataset=_Rows(torch.randint(3, 99, (8, 12)))).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    moved = [k for k, v in hf.state_dict().items() if not torch.equal(v, before[k])]
    assert any("head_embed" in k for k in moved) and any("ffn.gate" in k for k in moved)
