"""Hugging Face GPT-2/BERT weights in mhe models, and the encoder-decoder against torch's
Transformer layers: the same logits in float64 (every weight random), with padding."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from mhe.errors import MheError  # noqa: E402
from mhe.hf.weights import export_hf, import_hf  # noqa: E402
from mhe.models import build_model  # noqa: E402

TOL = 1e-12
TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32)


def rel_gap(a, b, keep=None):
    """max |a - b| / max |b| over the positions ``keep`` (``[B, T]``) or everything."""
    if keep is not None:
        a, b = a[keep], b[keep]
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def randomise(model):
    """Every parameter random (LayerNorm scales around 1), so no weight can be left out."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if ("LayerNorm.weight" in name or "ln_" in name or "norm" in name) and p.dim() == 1 else 0.0
            p.copy_(base + 0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def padded_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 99, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0  # right padding
    ids[1, 4:] = 0
    types = torch.zeros_like(ids)
    types[:, 3:] = 1
    return ids, mask, types


def gpt2():
    cfg = transformers.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=None, eos_token_id=None)
    return randomise(transformers.GPT2LMHeadModel(cfg).double().eval())


def bert(cls, **kw):
    return randomise(getattr(transformers, cls)(transformers.BertConfig(**TINY, **kw)).double().eval())


def test_gpt2_lm_logits_equal_hf():
    hf = gpt2()
    ours = import_hf(hf)
    assert ours.cfg.activation == "gelu_tanh" and ours.cfg.attn_bias and ours.cfg.layer_norm_eps == 1e-5
    ids, mask, _ = padded_batch()
    want = hf(input_ids=ids, attention_mask=mask).logits
    got = ours(ids, mask).logits
    gap = rel_gap(got, want, mask.bool())
    print(f"gpt2 lm gap {gap:.2e}")
    assert gap <= TOL


@pytest.mark.parametrize("cls, head", [("BertForMaskedLM", "mlm"), ("BertForSequenceClassification", "classification"),
                                       ("BertForQuestionAnswering", "qa")])
def test_bert_logits_equal_hf(cls, head):
    hf = bert(cls, num_labels=3) if head == "classification" else bert(cls)
    ours = import_hf(hf)
    assert ours.cfg.head == head and ours.cfg.activation == "gelu" and ours.cfg.layer_norm_eps == 1e-12
    ids, mask, types = padded_batch()
    out = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    got = ours(ids, mask, types).logits
    if head == "qa":
        want, keep = torch.stack([out.start_logits, out.end_logits], -1), mask.bool()
    else:
        want, keep = out.logits, (mask.bool() if head == "mlm" else None)
    gap = rel_gap(got, want, keep)
    print(f"bert {head} gap {gap:.2e}")
    assert gap <= TOL


@pytest.mark.parametrize("maker", ["gpt2", "BertForMaskedLM", "BertForSequenceClassification",
                                   "BertForQuestionAnswering"])
def test_export_round_trip_is_exact(maker, tmp_path):
    hf = gpt2() if maker == "gpt2" else bert(maker)
    ours = import_hf(hf)
    back = export_hf(ours)
    assert type(back) is type(hf)
    a, b = hf.state_dict(), back.state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    back.save_pretrained(tmp_path)  # a local directory loads as well
    again = import_hf(tmp_path, dtype=torch.float64)
    assert all(torch.equal(p, q) for p, q in zip(ours.state_dict().values(), again.state_dict().values()))


def test_presets_export_and_other_models_refuse():
    bert_small = build_model("tiny-encoder", vocab_size=99, d_model=32, n_heads=4, n_layers=1, max_len=16).double().eval()
    hf = export_hf(bert_small)
    ids, mask, types = padded_batch()
    ids = ids.clamp(max=98)
    gap = rel_gap(bert_small(ids, mask, types).logits, hf(input_ids=ids, attention_mask=mask, token_type_ids=types).logits,
                  mask.bool())
    assert gap <= TOL
    gpt = build_model("tiny-decoder", vocab_size=99, d_model=32, n_heads=4, n_layers=1, max_len=16).double().eval()
    hf = export_hf(gpt)
    assert rel_gap(gpt(ids, mask).logits, hf(input_ids=ids, attention_mask=mask).logits, mask.bool()) <= TOL
    with pytest.raises(MheError, match="attention"):
        export_hf(build_model("tiny-decoder", attention="mhe-mul", vocab_size=99, d_model=32, n_heads=4, n_layers=1))
    with pytest.raises(MheError, match="not a Hugging Face model directory"):
        import_hf("no/such/dir")


@pytest.mark.parametrize("attn_bias", [True, False])
def test_encoder_decoder_equals_torch_transformer_layers(attn_bias):
    """Post-LN, ReLU Transformer (the transformer-* presets) against torch's layer stacks
    fed the same embeddings; with ``attn_bias=False`` torch's attention biases are zero."""
    model = build_model("tiny-encoder-decoder", vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2,
                        max_len=32, attn_bias=attn_bias).double().eval()
    randomise(model)
    cfg = model.cfg
    assert cfg.activation == "relu" and not cfg.norm_first
    kw = dict(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, activation="relu", batch_first=True,
              norm_first=False, layer_norm_eps=cfg.layer_norm_eps, dtype=torch.float64)
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**kw), 2, enable_nested_tensor=False).eval()
    dec = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(**kw), 2).eval()

    def copy_attn(theirs, ours):
        theirs.in_proj_weight.copy_(torch.cat([ours.q_proj.weight, ours.k_proj.weight, ours.v_proj.weight]))
        theirs.out_proj.weight.copy_(ours.out_proj.weight)
        zero = torch.zeros(32, dtype=torch.float64)
        theirs.in_proj_bias.copy_(torch.cat([getattr(ours, n).bias if attn_bias else zero
                                             for n in ("q_proj", "k_proj", "v_proj")]))
        theirs.out_proj.bias.copy_(ours.out_proj.bias if attn_bias else zero)

    def copy_common(theirs, ours, norms):
        copy_attn(theirs.self_attn, ours.self_attn)
        theirs.linear1.load_state_dict(ours.ffn.fc_in.state_dict())
        theirs.linear2.load_state_dict(ours.ffn.fc_out.state_dict())
        for t, o in zip(norms, ("self_norm", "cross_norm", "ffn_norm") if len(norms) == 3 else ("self_norm", "ffn_norm")):
            getattr(theirs, t).load_state_dict(getattr(ours, o).state_dict())

    with torch.no_grad():
        for t, o in zip(enc.layers, model.encoder_layers):
            copy_common(t, o, ("norm1", "norm2"))
        for t, o in zip(dec.layers, model.decoder_layers):
            copy_common(t, o, ("norm1", "norm2", "norm3"))
            copy_attn(t.multihead_attn, o.cross_attn)
    src, src_mask, _ = padded_batch(1)
    tgt = torch.randint(1, 99, (2, 5))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    fast = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            memory = enc(model.embed(src), src_key_padding_mask=~src_mask.bool())
            h = dec(model.embed(tgt), memory, tgt_mask=causal, memory_key_padding_mask=~src_mask.bool())
            want = h @ model.embed.tokens.weight.t()
            got = model(src, tgt, src_mask=src_mask).logits
    finally:
        torch.backends.mha.set_fastpath_enabled(fast)
    gap = rel_gap(got, want)
    print(f"encoder-decoder (attn_bias={attn_bias}) gap {gap:.2e}")
    assert gap <= TOL
