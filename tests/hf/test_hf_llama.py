"""Hugging Face Llama, Qwen2 and Mistral checkpoints in mhe's Llama-style decoder: the same float64
logits, left-padded and through cached generation (ours: the static cache and the decode step of
``generate``; theirs: greedy decoding through their ``DynamicCache``, and the tokens of their
``generate``), on tiny random configurations built offline.

Hugging Face's RMSNorm casts its input to float32 whatever the dtype (``hidden_states.to(
torch.float32)`` in ``LlamaRMSNorm``, ``Qwen2RMSNorm``, ``MistralRMSNorm``), so in float64 the two
agree only to float32 rounding. The table therefore shows the gap to Hugging Face as shipped and
to Hugging Face with that one cast lifted (the same formula computed in the input dtype, patched
for the test); the second is float64 rounding. Run with ``-s`` to see the table.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402
from transformers.models.mistral import modeling_mistral  # noqa: E402
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402

from mhe.errors import MheError  # noqa: E402
from mhe.hf.modeling import CACHE_FIELD  # noqa: E402
from mhe.hf.weights import export_hf, import_hf  # noqa: E402
from mhe.models import build_model  # noqa: E402

TINY = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, bos_token_id=None, eos_token_id=None, pad_token_id=0)
# (label, class, config class, options): GQA, MQA, MHA; biases of each kind; tied and untied heads
FAMILIES = [
    ("llama gqa", "LlamaForCausalLM", "LlamaConfig", dict(num_key_value_heads=2, rms_norm_eps=1e-5)),
    ("llama mqa, biases, tied", "LlamaForCausalLM", "LlamaConfig",
     dict(num_key_value_heads=1, attention_bias=True, tie_word_embeddings=True,
          rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    ("qwen2 gqa (q/k/v biases)", "Qwen2ForCausalLM", "Qwen2Config",
     dict(num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    ("mistral mha, head_dim 16", "MistralForCausalLM", "MistralConfig",
     dict(num_key_value_heads=4, head_dim=16, sliding_window=None)),
]
NORMS = [(modeling_llama, "LlamaRMSNorm"), (modeling_qwen2, "Qwen2RMSNorm"), (modeling_mistral, "MistralRMSNorm")]


def _norm_in_input_dtype(self, h):
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture
def float64_norms(monkeypatch):
    for module, name in NORMS:
        monkeypatch.setattr(getattr(module, name), "forward", _norm_in_input_dtype)


def hf_model(cls, cfg_cls, opts):
    cfg = getattr(transformers, cfg_cls)(**TINY, **opts)
    cfg._attn_implementation = "sdpa"
    model = getattr(transformers, cls)(cfg).double().eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every weight random (norm gains around 1), so none can be left out
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    model.generation_config.eos_token_id = None
    return model


def left_padded(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :3] = 0  # row 0 is four tokens, left-padded
    ids[0, :3] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def rel_gap(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def hf_cached_greedy(hf, ids, mask, pos, new):
    """Greedy decoding through Hugging Face's own ``DynamicCache`` in float64 (``generate`` hands
    back float32 logits), one token a step: (tokens [B, P + new], logits [B, new, V])."""
    cache = transformers.DynamicCache(config=hf.config)
    arg = CACHE_FIELD
    out = hf(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, **{arg: cache})
    seq, logits = ids, []
    for _ in range(new):
        step = out.logits[:, -1]
        logits.append(step)
        tok = step.argmax(-1, keepdim=True)  # [B, 1]
        seq, mask, pos = torch.cat([seq, tok], 1), torch.cat([mask, torch.ones_like(tok)], 1), pos[:, -1:] + 1
        out = hf(input_ids=tok, attention_mask=mask, position_ids=pos, use_cache=True, **{arg: getattr(out, arg)})
    return seq, torch.stack(logits, 1)


def gaps(hf, ours, *, with_generate=False):
    """(forward gap on real tokens, cached-generation logits gap, same tokens as HF's cached
    greedy decoding and, ``with_generate``, as its ``generate``)."""
    ids, mask, pos = left_padded()
    with torch.no_grad():
        keep = mask.bool()
        fwd = rel_gap(ours(ids, mask, position_ids=pos).logits[keep],
                      hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[keep])
    want_tokens, want_logits = hf_cached_greedy(hf, ids, mask, pos, 6)
    tokens, logits = ours.generate(ids, 6, attention_mask=mask, return_logits=True)
    same = torch.equal(tokens, want_tokens)
    if with_generate:
        with torch.no_grad():
            same = same and torch.equal(tokens, hf.generate(ids, attention_mask=mask, max_new_tokens=6,
                                                            do_sample=False, pad_token_id=0))
    return fwd, rel_gap(logits, want_logits), same


def test_hf_equality_table(monkeypatch):
    rows = []
    for label, cls, cfg_cls, opts in FAMILIES:
        hf = hf_model(cls, cfg_cls, opts)
        ours = import_hf(hf)
        shipped = gaps(hf, ours, with_generate=True)
        for module, name in NORMS:
            monkeypatch.setattr(getattr(module, name), "forward", _norm_in_input_dtype)
        lifted = gaps(hf, ours)
        monkeypatch.undo()
        rows.append((label, ours.cfg.attention, *shipped[:2], *lifted[:2], shipped[2] and lifted[2]))
    print("\nfloat64 logits against Hugging Face (max |ours - HF| / max |HF|; left padding; greedy, 6 new tokens)")
    print(f"{'model':28} {'kind':5} {'forward, HF':>12} {'generate, HF':>13} {'forward, HF*':>13} "
          f"{'generate, HF*':>14}  tokens")
    for label, kind, f0, g0, f1, g1, same in rows:
        print(f"{label:28} {kind:5} {f0:12.1e} {g0:13.1e} {f1:13.1e} {g1:14.1e}  {'equal' if same else 'DIFFER'}")
    print("HF: as shipped (its RMSNorm computes in float32); HF*: its RMSNorm in the input dtype (float64)")
    for label, kind, f0, g0, f1, g1, same in rows:
        assert f1 <= 1e-14 and g1 <= 1e-14 and same, label
        assert f0 <= 1e-5 and g0 <= 1e-5, label  # float32 rounding of the norms, no more


@pytest.mark.parametrize("family", FAMILIES[:3], ids=[f[0] for f in FAMILIES[:3]])
def test_export_round_trip_is_exact(family, tmp_path):
    label, cls, cfg_cls, opts = family
    hf = hf_model(cls, cfg_cls, opts)
    ours = import_hf(hf)
    back = export_hf(ours, family=cls[:-len("ForCausalLM")].lower())
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    back.save_pretrained(tmp_path)  # a local directory imports too
    again = import_hf(tmp_path, dtype=torch.float64)
    assert again.cfg == ours.cfg
    assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("kind", ["gqa", "mqa", "mha"])
def test_llama_preset_exports_and_equals_hf(kind, float64_norms):
    ours = build_model("llama-tiny", attention=kind, vocab_size=99, d_model=32, n_layers=1, d_ff=48,
                       max_len=32).double().eval()
    hf = export_hf(ours)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.config.num_key_value_heads == {"gqa": 2, "mqa": 1,
                                                                                       "mha": 4}[kind]
    ids, mask, pos = left_padded()
    with torch.no_grad():
        gap = rel_gap(ours(ids, mask, position_ids=pos).logits[mask.bool()],
                      hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[mask.bool()])
    assert gap <= 1e-14


def test_what_cannot_be_imported_or_exported_is_one_line():
    cases = [
        (lambda: import_hf(hf_model("MistralForCausalLM", "MistralConfig", dict(sliding_window=16))), "sliding_window"),
        (lambda: import_hf(hf_model("LlamaForCausalLM", "LlamaConfig", dict(
            rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}))), "rope_type"),
        (lambda: import_hf(hf_model("LlamaForCausalLM", "LlamaConfig", dict(mlp_bias=True))), "mlp_bias"),
        (lambda: export_hf(build_model("llama-tiny", attention="mhe-mul")), "attention"),
        (lambda: export_hf(build_model("llama-tiny", rope_fraction=0.5)), "rope_fraction"),
        (lambda: export_hf(build_model("llama-tiny"), family="qwen2"), "attn_bias"),
        (lambda: export_hf(build_model("llama-tiny"), family="gemma"), "gemma"),
    ]
    for make, word in cases:
        with pytest.raises(MheError) as e:
            make()
        assert "\n" not in str(e.value) and word in str(e.value), str(e.value)
