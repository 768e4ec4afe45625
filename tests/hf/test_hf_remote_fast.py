"""The exported modeling code (:mod:`mhe.hf.remote`) runs MHE at multi-query cost, as mhe's
inference view does: the cache holds one K/V head per layer (dynamic and static cache), SDPA
reads that head without a copy per query head, the head-embedding folds are made once per set of
weights (and never in training), the static cache and ``torch.compile`` give generate's tokens
and logits. Equality with the core model: tests/hf/test_hf_export.py.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import CompileConfig, DynamicCache, StaticCache  # noqa: E402

import mhe.hf.remote.layers_mhe as layers  # noqa: E402
from mhe.hf.export import save_model, to_remote  # noqa: E402
from mhe.hf.remote.modeling_mhe import MheForCausalLM  # noqa: E402
from mhe.models import build_model  # noqa: E402
from weights_kept import perturb  # noqa: E402

SMALL = dict(vocab_size=61, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_len=24)
TOL = dict(rtol=0, atol=1e-12)


def perturbed(preset, kind, order=None, **kw):
    opts = {"attn_options": {"rope_order": order}} if order else {}
    return perturb(build_model(preset, attention=kind, **{**SMALL, **opts, **kw}).double().eval())


def ids(seed=0, batch=2, length=9):
    return torch.randint(7, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


def cache_bytes(cache) -> int:
    """Bytes of every key and value tensor the cache holds."""
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def filled(hf, which: str):
    """The cache after a forward of a prompt: transformers' dynamic cache, or its static cache
    sized by the model's config."""
    cache = DynamicCache(config=hf.config) if which == "dynamic" else StaticCache(config=hf.config, max_cache_len=16)
    with torch.no_grad():
        hf(ids(), cache=cache)
    return cache


@pytest.mark.parametrize("which", ["dynamic", "static"])
@pytest.mark.parametrize("preset", ["llama-tiny", "tiny-decoder"])
def test_cache_holds_one_kv_head(preset, which):
    """MHE's cache, measured from its tensors, is 1/n_heads of MHA's (rotary: rope-then-psi);
    psi-then-rope caches n heads, as MHA does. The config says so for transformers' caches."""
    mha = to_remote(perturbed(preset, "mha"))
    mhe = to_remote(perturbed(preset, "mhe-mul"))
    assert mhe.config.num_key_value_heads == 1 and mha.config.num_key_value_heads == SMALL["n_heads"]
    one, full = filled(mhe, which), filled(mha, which)
    assert all(layer.keys.shape[1] == layer.values.shape[1] == 1 for layer in one.layers)
    assert cache_bytes(one) * SMALL["n_heads"] == cache_bytes(full) > 0
    if preset == "llama-tiny":
        literal = to_remote(perturbed(preset, "mhe-mul", "psi-then-rope"))
        assert cache_bytes(filled(literal, which)) == cache_bytes(full)


def test_exported_checkpoint_loads_with_one_kv_head(tmp_path):
    """The folder's config caches one head; the checkpoint loads into it and computes the core's logits."""
    core = perturbed("llama-tiny", "mhe-mul")
    save_model(core, tmp_path / "out")
    loaded = MheForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert loaded.config.num_key_value_heads == 1
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, core(x).logits, **TOL)


GENERATE = [("llama-tiny", "mhe-mul"), ("llama-tiny", "mhe-add"), ("tiny-decoder", "mhe-mul"),
            ("llama-tiny", "gqa"), ("tiny-decoder", "mqa")]


@pytest.mark.parametrize("preset, kind", GENERATE, ids=[f"{p}-{k}" for p, k in GENERATE])
def test_static_cache_generate_equals_dynamic_and_core(preset, kind):
    """Greedy generate with the static cache (float64 model): the dynamic cache's tokens and the
    core ``generate``'s, and logits equal to both."""
    core = perturbed(preset, kind)
    hf = to_remote(core).eval()
    x = ids()
    got = {}
    with torch.no_grad():
        for cache in ("static", "dynamic"):
            out = hf.generate(x, max_new_tokens=6, do_sample=False, cache_implementation=cache,
                              return_dict_in_generate=True, output_logits=True)
            got[cache] = out.sequences, torch.stack(out.logits, 1)
        tokens, logits = core.generate(x, 6, return_logits=True)
    assert torch.equal(got["static"][0], got["dynamic"][0]) and torch.equal(got["static"][0], tokens)
    # generate returns float32 logits: equal to float64 ones rounded, to one unit in the last place
    one_ulp = dict(rtol=2 ** -22, atol=0)
    torch.testing.assert_close(got["static"][1], got["dynamic"][1], **one_ulp)
    torch.testing.assert_close(got["static"][1], logits.float(), **one_ulp)


def test_static_cache_decode_without_a_mask():
    """A static cache driven by hand (no mask): each step sees the keys up to its own position,
    as with the dynamic cache (the static cache advances its length during the step)."""
    hf = to_remote(perturbed("llama-tiny", "mhe-mul"))
    x = ids()
    with torch.no_grad():
        want = hf(x).logits[:, 5:8]  # positions 5, 6, 7
        static = StaticCache(config=hf.config, max_cache_len=16)
        got = [hf(x[:, :6], cache=static).logits[:, -1]]
        got += [hf(x[:, i:i + 1], cache=static).logits[:, -1] for i in (6, 7)]
    torch.testing.assert_close(torch.stack(got, 1), want, **TOL)


def test_reset_static_cache_prompt_reads_one_kv_head(monkeypatch):
    """A prompt into a static cache that was filled and reset (its length a tensor at 0) takes the
    causal path over the one K/V head, as a new cache does, with the same logits."""
    hf = to_remote(perturbed("llama-tiny", "mhe-mul"))
    x = ids()
    static = StaticCache(config=hf.config, max_cache_len=16)
    with torch.no_grad():
        want = hf(x, cache=static).logits
        static.reset()
        monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: pytest.fail("K/V repeated"))
        torch.testing.assert_close(hf(x, cache=static).logits, want, **TOL)


def test_attention_reads_one_kv_head(monkeypatch):
    """Every SDPA call of an MHE generate gets the one shared K/V head: a decode step's n query
    heads as rows of one query, the prompt's through ``enable_gqa``; nothing repeats K/V."""
    hf = to_remote(perturbed("llama-tiny", "mhe-mul"))
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[1], q.shape[2], k.shape[1], v.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", lambda *a, **k: pytest.fail("K/V repeated"))
    with torch.no_grad():
        hf.generate(ids(batch=1), max_new_tokens=3, do_sample=False, cache_implementation="static")
    layers_n = SMALL["n_layers"]
    assert seen[:layers_n] == [(4, 9, 1, 1, True)] * layers_n  # the prompt: 4 heads over one K/V head
    assert seen[layers_n:] == [(1, 4, 1, 1, False)] * (2 * layers_n)  # each new token: 4 rows of one query


def test_folds_made_once_and_remade_when_weights_change(monkeypatch):
    """Eval without gradients reads the folds made at the first call (buffers outside the state
    dict); an in-place change of the weights makes them again; training drops them and computes
    from the weights, with gradients reaching the head embeddings."""
    core = perturbed("llama-tiny", "mhe-mul")
    hf = to_remote(core).eval()
    made, fold = [], layers.Attention._fold
    monkeypatch.setattr(layers.Attention, "_fold", lambda self, key: (made.append(self), fold(self, key)))
    x = ids()
    with torch.no_grad():
        first = hf(x).logits
        torch.testing.assert_close(hf(x).logits, first, rtol=0, atol=0)
    assert len(made) == SMALL["n_layers"]
    attn = hf.decoder.layers[0].self_attn
    assert attn.fold_out_weight is not None and not any("fold" in k for k in hf.state_dict())
    with torch.no_grad():
        for p in (attn.head_embed, core.decoder.layers[0].self_attn.head_embed):
            p.mul_(1.5)
        torch.testing.assert_close(hf(x).logits, core(x).logits, **TOL)
    assert len(made) == SMALL["n_layers"] + 1
    hf.train()
    assert "fold_query" not in dict(hf.named_buffers(recurse=True)).keys() | set(attn._buffers)
    hf(x).logits.sum().backward()
    assert attn.head_embed.grad.abs().sum() > 0 and len(made) == SMALL["n_layers"] + 1


def test_folds_follow_a_merged_adapter():
    """A model run in eval mode, then wrapped by peft with LoRA on ``out_proj`` and merged at once
    (``merge_and_unload`` writes W^O through ``.data``, which no version counter sees): its next call
    computes with the merged weight, as the adapter did unmerged."""
    peft = pytest.importorskip("peft")
    hf = to_remote(perturbed("llama-tiny", "mhe-mul")).eval()
    x = ids()
    with torch.no_grad():
        base = hf(x).logits  # the folds made from the weights before the adapter
        wrapped = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["out_proj"],
                                                          init_lora_weights=False))
        unmerged = copy.deepcopy(wrapped)(input_ids=x).logits
        merged = wrapped.merge_and_unload()(x).logits
    assert (unmerged - base).abs().max() > 1e-3
    torch.testing.assert_close(merged, unmerged, **TOL)


def test_logits_to_keep():
    hf = to_remote(perturbed("llama-tiny", "mhe-mul"))
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x, logits_to_keep=1).logits, hf(x).logits[:, -1:], **TOL)


@pytest.mark.parametrize("kind", ["mhe-mul", "gqa"])
def test_compiled_static_generate(kind):
    """``generate``'s compiled decode step (transformers' own path on a GPU, here forced on the CPU
    with dynamo's eager backend): one graph without breaks (fullgraph), the uncompiled tokens."""
    hf = to_remote(perturbed("llama-tiny", kind)).eval()
    x = ids()
    with torch.no_grad():
        want = hf.generate(x, max_new_tokens=5, do_sample=False, cache_implementation="static")
        config = CompileConfig(fullgraph=True, backend="eager", mode=None)
        config._compile_all_devices = True
        torch._dynamo.reset()
        got = hf.generate(x, max_new_tokens=5, do_sample=False, cache_implementation="static", compile_config=config)
    assert hasattr(hf, "_compiled_call") and torch.equal(got, want)


def reference_attention(q, k, v, mask, causal):
    """softmax(q k^T / sqrt(d)) v written out, K/V heads repeated to the query heads."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if causal:  # query i sees keys 0 .. i
        t, keys = q.shape[2], k.shape[2]
        scores = scores.masked_fill(torch.arange(keys)[None, :] > torch.arange(t)[:, None], float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


CASES = {"one token, mask": (1, True, False), "one token": (1, False, False), "prompt, causal": (5, False, True),
         "prompt, mask": (5, True, False)}


@pytest.mark.parametrize("fused", [True, False], ids=["gqa-kernel", "no-gqa-kernel"])
@pytest.mark.parametrize("heads", [(4, 1), (4, 2), (4, 4)], ids=["one-kv", "grouped", "mha"])
@pytest.mark.parametrize("case", CASES)
def test_attend_equals_the_written_out_attention(case, heads, fused, monkeypatch):
    """Every branch of ``attend`` (the query heads as rows of one query, SDPA's ``enable_gqa``, the
    repeated K/V where no fused kernel reads grouped heads, a static cache's unfilled keys past a
    causal prompt) computes the written-out attention."""
    monkeypatch.setattr(layers, "_gqa_fused", lambda q: fused)
    t, masked, causal = CASES[case]
    (n, g), keys = heads, 7
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, s, 8, generator=gen, dtype=torch.float64) for h, s in ((n, t), (g, keys), (g, keys)))
    mask = torch.rand(2, 1, t, keys, generator=gen) > 0.3 if masked else None
    if mask is not None:
        mask[..., 0] = True  # every query sees a key
    want = reference_attention(q, k[:, :, :t] if causal else k, v[:, :, :t] if causal else v, mask, causal)
    torch.testing.assert_close(layers.attend(q, k, v, mask, 0.0, causal), want, **TOL)
