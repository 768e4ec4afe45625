"""The padded vocabulary (mhe.models.vocab_padding): the matrices hold a multiple of 64 rows,
everything outside sees the real vocabulary."""

import pytest
import torch

from mhe.models import build_model
from mhe.models.vocab_padding import pad_optimizer_state, pad_vocabulary, padded_size, padding_numel
from mhe.training.optim import build_optimizer
from mhe.training.config import TrainConfig

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=1, dropout=0.0, attn_dropout=0.0)
PRESETS = ["tiny-decoder", "tiny-encoder", "tiny-encoder-decoder"]


def model_of(name, seed=0, **kw):
    torch.manual_seed(seed)
    return build_model(name, **{**SMALL, **kw})


def logits_of(model, ids):
    return model(ids, ids).logits if model.cfg.arch == "encoder-decoder" else model(ids).logits


def test_padded_size():
    assert [padded_size(v) for v in (50257, 30522, 64, 1, 99)] == [50304, 30528, 64, 64, 128]


@pytest.mark.parametrize("name", PRESETS)
def test_padding_changes_no_output_and_no_state_dict(name):
    """The same logits to float64 rounding (a GEMM over 128 rows blocks its tail differently from one
    over 99, which is why CPU runs stay unpadded), the real shapes and values in the state dict."""
    plain = model_of(name).double()
    padded = model_of(name).double()
    want_state = plain.state_dict()
    assert pad_vocabulary(padded) == 128
    ids = torch.randint(0, 99, (2, 7))
    torch.testing.assert_close(logits_of(padded, ids), logits_of(plain, ids), rtol=1e-13, atol=1e-15)
    assert logits_of(padded, ids).shape[-1] == 99
    state = padded.state_dict()
    assert state.keys() == want_state.keys()
    for k, v in want_state.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=0, msg=k)
    emb = [m for m in padded.modules() if isinstance(m, torch.nn.Embedding)][0]
    assert emb.weight.shape[0] == 128 and not emb.weight[99:].any()
    assert emb.num_embeddings == 99  # id checks keep the real vocabulary
    n_real = sum(p.numel() for p in {id(p): p for p in plain.parameters()}.values())
    n_padded = sum(p.numel() for p in {id(p): p for p in padded.parameters()}.values())
    assert n_padded - padding_numel(padded) == n_real


def test_initialisation_draws_the_same_numbers_padded_or_not():
    """Padding happens after initialisation, so the real rows are what an unpadded build draws
    and the next draw from the generator is the same."""
    a = model_of("tiny-decoder", seed=7)
    after_a = torch.rand(3)
    b = model_of("tiny-decoder", seed=7)
    pad_vocabulary(b)
    after_b = torch.rand(3)
    torch.testing.assert_close(b.state_dict()["lm_head.weight"], a.state_dict()["lm_head.weight"], rtol=0, atol=0)
    torch.testing.assert_close(after_b, after_a, rtol=0, atol=0)


def test_tied_weights_stay_tied_and_unpadded_weights_load():
    padded = model_of("tiny-decoder")
    pad_vocabulary(padded)
    assert padded.lm_head.weight is padded.decoder.embed.tokens.weight
    other = model_of("tiny-decoder", seed=3)
    padded.load_state_dict(other.state_dict())  # a run folder's [V, m] weights
    torch.testing.assert_close(padded.lm_head.weight[:99], other.lm_head.weight, rtol=0, atol=0)
    assert not padded.lm_head.weight[99:].any()
    back = model_of("tiny-decoder", seed=5)
    back.load_state_dict(padded.state_dict())  # and a padded model's weights load unpadded
    torch.testing.assert_close(back.lm_head.weight, other.lm_head.weight, rtol=0, atol=0)


def test_training_steps_keep_the_padding_zero_and_the_optimiser_state_real():
    """AdamW with weight decay over several steps leaves the padding rows at exactly zero; the
    optimiser's state dict holds [V, m] moments and loads into an unpadded model's optimiser."""
    model = model_of("tiny-encoder")
    pad_vocabulary(model)
    t = TrainConfig(lr=1e-2, weight_decay=0.1, warmup_steps=0)
    opt, _ = build_optimizer(model, t)
    pad_optimizer_state(opt, model)
    ids = torch.randint(0, 99, (2, 7))
    for _ in range(3):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    assert not model.decoder.weight[99:].any() and not model.decoder.bias[99:].any()
    state = opt.state_dict()
    order = [p for g in opt.param_groups for p in g["params"]]
    for p, rows in ((model.decoder.weight, (99, 32)), (model.decoder.bias, (99,))):
        i = next(i for i, q in enumerate(order) if q is p)
        assert tuple(state["state"][i]["exp_avg"].shape) == tuple(state["state"][i]["exp_avg_sq"].shape) == rows
    assert opt.state[model.decoder.weight]["exp_avg"].shape == (128, 32)  # the live state stays padded
    plain = model_of("tiny-encoder")
    plain.load_state_dict(model.state_dict())
    opt2, _ = build_optimizer(plain, t)
    opt2.load_state_dict(state)
    plain(ids, labels=ids).loss.backward()
    opt2.step()  # the moments fit the unpadded parameters
    opt3, _ = build_optimizer(model, t)
    pad_optimizer_state(opt3, model)
    opt3.load_state_dict(state)  # and a padded one again
    assert opt3.state[model.decoder.weight]["exp_avg"].shape == (128, 32)


def test_generation_of_a_padded_model_is_unchanged():
    plain, padded = model_of("tiny-decoder").eval(), model_of("tiny-decoder").eval()
    pad_vocabulary(padded)
    ids = torch.randint(0, 99, (2, 5))
    a, la = plain.generate(ids, 6, step_mode="eager", return_logits=True)
    b, lb = padded.generate(ids, 6, step_mode="eager", return_logits=True)
    assert torch.equal(a, b)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-6)
