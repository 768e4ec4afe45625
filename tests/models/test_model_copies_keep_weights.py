"""Every function that returns a folded, viewed, cast or loaded model keeps the weights it is
given bit for bit, or computes the same function (and says which in its docstring).

Each starts from weights no initialiser produces (every parameter moved by a normal draw,
:func:`weights_kept.perturb`), or from a trained run folder.
"""

import copy

import pytest
import torch

from mhe.attention.folding import fold_model, inference_view
from mhe.models import build_model
from mhe.tasks.init_from import init_weights, source_checkpoint
from mhe.tasks.runs import load_run
from mhe.tasks.translation import TranslationTask
from mhe.training import checkpoint as ckpt
from mhe.training.weights import has_best, read_sealed_weights
from weights_kept import assert_kept, perturb, snapshot

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32)
TOL = dict(rtol=1e-12, atol=1e-12)
MODELS = [("tiny-decoder", "mhe-mul"), ("tiny-decoder", "mhe-add"), ("tiny-encoder", "mhe-mul"),
          ("tiny-encoder-decoder", "mhe-add"), ("tiny-decoder", "mha")]


def perturbed(preset, kind):
    return perturb(build_model(preset, attention=kind, **SMALL).double().eval())


def logits(model, arch, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 99, (2, 7), generator=g)
    with torch.no_grad():
        if arch == "encoder-decoder":
            return model(ids, torch.randint(7, 99, (2, 5), generator=g)).logits
        return model(ids).logits


@pytest.mark.parametrize("preset, kind", MODELS)
def test_fold_model_computes_the_same_function(preset, kind):
    """``fold_model`` replaces each fast MHE sublayer by the MQA sublayer it equals: the same
    logits in float64; every weight outside the folded sublayers is kept bit for bit."""
    m = perturbed(preset, kind)
    before, want = snapshot(m), logits(m, m.cfg.arch)
    folded = fold_model(m)
    assert folded is m
    kept = {k: v for k, v in folded.state_dict().items() if "attn." not in k}
    assert_kept(kept, {k: v for k, v in before.items() if "attn." not in k})
    if kind == "mha":  # nothing to fold
        assert_kept(folded.state_dict(), before)
    torch.testing.assert_close(logits(folded, m.cfg.arch), want, **TOL)


@pytest.mark.parametrize("preset, kind", MODELS)
def test_inference_view_leaves_the_model_and_computes_the_same_function(preset, kind):
    """The view generation runs: the model itself is left bit for bit as it was, the view's
    logits are the model's (float64) and every weight it does not fold is the model's own."""
    m = perturbed(preset, kind)
    before, want = snapshot(m), logits(m, m.cfg.arch)
    view = inference_view(m)
    assert_kept(m.state_dict(), before)
    torch.testing.assert_close(logits(view, m.cfg.arch), want, **TOL)
    shared = {p.data_ptr() for p in m.parameters()}
    assert all(p.data_ptr() in shared for n, p in view.named_parameters() if "attn." not in n)


def test_bfloat16_decoding_copy_rounds_each_weight_and_leaves_the_model():
    """Beam search's bfloat16 copy (``mt`` decoding with ``decode_dtype=bfloat16``): each weight
    is the model's rounded to bfloat16, nothing else; the float32 model is left as it was."""
    m = perturb(build_model("tiny-encoder-decoder", attention="mhe-mul", **SMALL).eval())
    before = snapshot(m)
    cast = TranslationTask()._decoding_model(m, "bfloat16")
    assert cast is not m
    assert_kept(m.state_dict(), before)
    assert_kept(cast.state_dict(), {k: v.to(torch.bfloat16) for k, v in before.items()})


def _loaded_from(run):
    """The sealed weights ``load_run`` reads: ``best/`` when there is one, else the newest checkpoint."""
    folder = run / "best" if has_best(run) else ckpt.latest_checkpoint(run / "checkpoints")
    return read_sealed_weights(folder)


@pytest.mark.parametrize("which", ["lm_run", "mt_run"])
def test_load_run_keeps_the_saved_weights(which, request):
    run = request.getfixturevalue(which)
    model = load_run(run, inference=True)[0]
    saved = _loaded_from(run)
    assert_kept({k: v for k, v in model.state_dict().items() if k in saved}, saved)
    assert set(model.state_dict()) - set(saved) <= {"lm_head.weight", "decoder.weight"}  # tied to the embeddings


def test_load_run_of_a_checkpoint_folder_keeps_its_weights(lm_run):
    point = ckpt.latest_checkpoint(lm_run / "checkpoints")
    model = load_run(point, inference=True)[0]
    saved = read_sealed_weights(point)
    assert_kept({k: v for k, v in model.state_dict().items() if k in saved}, saved)


def test_init_from_copies_the_source_weights(lm_run):
    """``train.init_from`` (``--init-from``): the new model holds the source run's newest
    checkpoint, bit for bit, whatever it was initialised with."""
    model = perturb(copy.deepcopy(load_run(lm_run, inference=True)[0]))
    init_weights(model, lm_run)
    saved = read_sealed_weights(source_checkpoint(lm_run))
    assert_kept({k: v for k, v in model.state_dict().items() if k in saved}, saved)
