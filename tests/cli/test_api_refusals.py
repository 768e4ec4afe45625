"""Python API calls that used to fail deep inside (IndexError, RuntimeError, AttributeError) or
to answer silently: each is one :class:`MheError` naming the bad value, raised at the call's
entry, and decoding refuses logits that are not finite, naming the step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mhe.errors import MheError
from mhe.models import build_model
from mhe.generation.beam import beam_search
from mhe.generation.session import generate

V = 40


def _decoder(**over):
    return build_model("tiny-decoder", vocab_size=V, d_model=16, d_ff=32, n_layers=1, n_heads=2, max_len=32,
                       **over).eval()


def _seq2seq():
    return build_model("tiny-encoder-decoder", vocab_size=V, d_model=16, d_ff=32, n_layers=1, n_heads=2,
                       max_len=16).eval()


def _poisoned(model):
    """``model`` with NaN in its first block's feed-forward output weight: every logit is NaN."""
    with torch.no_grad():
        model.decoder.layers[0].ffn.fc_out.weight.fill_(float("nan"))
    return model


CASES = [
    ("generate-empty-prompt", lambda: generate(_decoder(), torch.zeros(1, 0, dtype=torch.long), 3),
     "got a torch.int64 tensor of shape (1, 0)"),
    ("generate-no-prompts", lambda: generate(_decoder(), torch.zeros(0, 4, dtype=torch.long), 3),
     "shape (0, 4)"),
    ("generate-1d-ids", lambda: generate(_decoder(), torch.tensor([1, 2, 3]), 3), "shape (3,)"),
    ("generate-float-ids", lambda: generate(_decoder(), torch.ones(1, 3), 3), "torch.float32 tensor"),
    ("generate-mask-shape", lambda: generate(_decoder(), torch.ones(2, 4, dtype=torch.long), 3,
                                             attention_mask=torch.ones(2, 5, dtype=torch.long)),
     "attention_mask must have the shape of input_ids (2, 4), got (2, 5)"),
    ("beam-max-len-zero", lambda: beam_search(_seq2seq(), torch.ones(1, 3, dtype=torch.long), bos_id=1, eos_id=2,
                                              max_len=0), "max_len must be an integer >= 2, got 0"),
    ("beam-max-len-one", lambda: beam_search(_seq2seq(), torch.ones(1, 3, dtype=torch.long), bos_id=1, eos_id=2,
                                             max_len=1), "max_len must be an integer >= 2, got 1"),
    ("beam-zero", lambda: beam_search(_seq2seq(), torch.ones(1, 3, dtype=torch.long), bos_id=1, eos_id=2, beam=0),
     "beam must be an integer >= 1, got 0"),
    ("beam-empty-source", lambda: beam_search(_seq2seq(), torch.ones(1, 0, dtype=torch.long), bos_id=1, eos_id=2),
     "src must be token ids [B, S]"),
    ("beam-mask-shape", lambda: beam_search(_seq2seq(), torch.ones(2, 3, dtype=torch.long),
                                            torch.ones(2, 4, dtype=torch.bool), bos_id=1, eos_id=2),
     "src_mask must have the shape of src (2, 3), got (2, 4)"),
    ("beam-all-masked-row", lambda: beam_search(_seq2seq(), torch.ones(2, 3, dtype=torch.long),
                                                torch.tensor([[1, 1, 0], [0, 0, 0]]), bos_id=1, eos_id=2),
     "src_mask row 1 masks every source token"),
    ("attention-no-tokens", lambda: _decoder().decoder.layers[0].self_attn(torch.zeros(2, 0, 16)),
     "input must hold at least one sequence of at least one token [B >= 1, T >= 1, d_model=16], got (2, 0, 16)"),
    ("attention-no-batch", lambda: _decoder().decoder.layers[0].self_attn(torch.zeros(0, 3, 16)), "got (0, 3, 16)"),
    ("cross-attention-no-keys", lambda: _seq2seq().decoder_layers[0].cross_attn(torch.zeros(1, 2, 16),
                                                                                context=torch.zeros(1, 0, 16)),
     "context must hold at least one token to attend to"),
]


@pytest.mark.parametrize("call, named", [pytest.param(c, n, id=i) for i, c, n in CASES])
def test_bad_api_input_is_one_error_naming_the_value(call, named):
    with pytest.raises(MheError) as info:
        call()
    assert named in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("what", ["to_hf", "convert_model"])
@pytest.mark.parametrize("module", [nn.Linear(4, 4), nn.Sequential(), "a string"], ids=["linear", "sequential", "str"])
def test_a_module_that_is_not_an_mhe_model_is_refused(what, module):
    if what == "to_hf":
        pytest.importorskip("transformers")
        from mhe.hf import to_hf as call
    else:
        from mhe.convert import convert_model as call
    with pytest.raises(MheError, match=rf"^{what} takes an mhe model \(.*DecoderForCausalLM.*\), "
                                       rf"got {type(module).__name__}$"):
        call(module) if what == "to_hf" else call(module, "mqa")


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampling"])
def test_generation_refuses_nan_logits_naming_the_step(sample):
    model = _poisoned(_decoder())
    with pytest.raises(MheError, match=r"the logits of new token 1 \(generation step 1\) are not finite"):
        generate(model, torch.ones(2, 3, dtype=torch.long), 4, do_sample=sample, seed=0)


def test_generation_names_the_first_step_whose_logits_are_not_finite():
    """Positions from 5 on are poisoned: prompt positions 0..2 give new token 1, which sits at
    position 3 and gives token 2, ..., so the logits of token 4 (read at position 5) are the first
    NaN ones: the error names step 4, not 1."""
    model = _decoder()
    with torch.no_grad():
        model.decoder.embed.positions.weight[5:] = float("nan")
    out = generate(model, torch.ones(1, 3, dtype=torch.long), 3)  # read at positions 2, 3, 4: finite, answered
    assert out.shape == (1, 6)
    with pytest.raises(MheError, match=r"new token 4 \(generation step 4\)"):
        generate(model, torch.ones(1, 3, dtype=torch.long), 5, do_sample=True, seed=1)


def test_beam_search_refuses_nan_logits_naming_the_step():
    model = _seq2seq()
    with torch.no_grad():
        model.decoder_layers[0].ffn.fc_out.weight.fill_(float("nan"))  # the decoder's logits only
    with pytest.raises(MheError, match=r"beam search: the logits of step 1 \(target position 1\) are not finite"):
        beam_search(model, torch.ones(1, 3, dtype=torch.long), bos_id=1, eos_id=2, max_len=6)
