"""The Hugging Face adapter keeps the weights it is given, bit for bit.

Every test starts from weights no initialiser produces (every parameter moved by a normal
draw, :func:`weights_kept.perturb`). ``to_hf`` and each adapter class built around a core
must leave every tensor as it was; ``from_config`` initialises as the model family does;
``from_pretrained`` initialises only what a checkpoint lacks; ``import_hf``/``export_hf``
copy exactly; and a run folder reaches transformers and comes back with its own logits.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")
import mhe.hf  # noqa: E402,F401  (registers the Auto classes)
from conftest import require_data  # noqa: E402
from mhe.cli import main  # noqa: E402
from mhe.hf import export_hf, from_hf, import_hf, to_hf  # noqa: E402
from mhe.models import MODEL_CLASSES, build_model  # noqa: E402
from mhe.tasks.hf_runs import from_run  # noqa: E402
from mhe.tasks.runs import load_run  # noqa: E402
from weights_kept import assert_kept, changed, perturb, snapshot  # noqa: E402

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, n_layers=2, d_ff=64, max_len=32)
TOL = dict(rtol=1e-12, atol=1e-12)
HEADS = [("tiny-encoder", {}), ("tiny-encoder", {"head": "classification", "num_labels": 3}),
         ("tiny-encoder", {"head": "qa"}), ("tiny-decoder", {}), ("tiny-decoder", {"head": "classification"}),
         ("tiny-encoder-decoder", {})]
CASES = [(p, kw, kind) for p, kw in HEADS for kind in ("mha", "mhe-mul")] + [("tiny-encoder-decoder", {}, "mhe-add")]


def perturbed(preset, kind="mhe-mul", **kw):
    return perturb(build_model(preset, attention=kind, **{**SMALL, **kw}).double().eval())


def batch(arch, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, 99, (2, 7), generator=g)
    return (ids, torch.randint(7, 99, (2, 5), generator=g)) if arch == "encoder-decoder" else (ids,)


def core_logits(model, x):
    """The core model's output in the form the adapter returns (QA: start and end stacked)."""
    with torch.no_grad():
        return model(*x).logits


def hf_logits(hf, x):
    with torch.no_grad():
        if len(x) == 2:
            return hf(input_ids=x[0], decoder_input_ids=x[1]).logits
        out = hf(input_ids=x[0])
        return torch.stack([out.start_logits, out.end_logits], -1) if hasattr(out, "start_logits") else out.logits


@pytest.mark.parametrize("preset, kw, kind", CASES,
                         ids=[f"{p}-{kw.get('head', 'default')}-{k}" for p, kw, k in CASES])
def test_to_hf_keeps_every_weight(preset, kw, kind):
    """``to_hf`` builds each adapter class around the core (all six are reached here): the core
    keeps every tensor bit for bit and the adapter computes what the core computed before."""
    m = perturbed(preset, kind, **kw)
    before, x = snapshot(m), batch(m.cfg.arch)
    want = core_logits(m, x)
    hf = to_hf(m, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    assert from_hf(hf) is m  # wraps, never copies
    assert_kept(m.state_dict(), before)
    assert_kept({k.removeprefix("mhe."): v for k, v in hf.state_dict().items()}, before)
    torch.testing.assert_close(hf_logits(hf.eval(), x), want, **TOL)
    torch.testing.assert_close(core_logits(m, x), want, rtol=0, atol=0)


@pytest.mark.parametrize("preset, head, auto", [
    ("tiny-encoder", "mlm", transformers.AutoModelForMaskedLM),
    ("tiny-decoder", "lm", transformers.AutoModelForCausalLM),
    ("tiny-encoder-decoder", "seq2seq", transformers.AutoModelForSeq2SeqLM)])
def test_from_config_initialises_as_the_family(preset, head, auto):
    """A model that builds its own core is initialised by the core's family scheme
    (``reset_parameters``: BERT, GPT-2 with scaled residual projections, or Transformer)."""
    cfg = build_model(preset, attention="mhe-mul", **SMALL).cfg
    config = mhe.hf.convert._hf_class(cfg.arch, head).config_class.from_model_config(cfg)
    torch.manual_seed(3)
    hf = auto.from_config(config)
    torch.manual_seed(3)
    want = MODEL_CLASSES[(cfg.arch, head)](cfg)
    want.reset_parameters()
    assert_kept({k.removeprefix("mhe."): v for k, v in hf.state_dict().items()}, snapshot(want))


def _std(t):
    return float(t.detach().std())


@pytest.mark.parametrize("preset", ["tiny-encoder", "tiny-decoder", "tiny-encoder-decoder"])
def test_reset_parameters_draws_the_family_scheme_with_tied_weights(preset):
    """Re-initialising a built (tied) core: LayerNorms 1 and 0, biases 0, the tied token
    embeddings keep the embedding's distribution (Transformer: N(0, m^-1/2), not the output
    layer's Glorot), GPT-2's residual projections N(0, 0.02 / sqrt(2 L))."""
    m = perturbed(preset).float()
    m.reset_parameters()
    for name, p in m.named_parameters():
        if name.endswith("norm.weight") or (p.dim() == 1 and "norm" in name and name.endswith("weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
    tokens = m.embed.tokens.weight if preset == "tiny-encoder-decoder" else (
        m.decoder.embed.tokens.weight if preset == "tiny-decoder" else m.encoder.embed.tokens.weight)
    want = SMALL["d_model"] ** -0.5 if preset == "tiny-encoder-decoder" else 0.02
    assert abs(_std(tokens) / want - 1) < 0.1, _std(tokens)
    if preset == "tiny-decoder":
        out = m.decoder.layers[0].self_attn.out_proj.weight
        assert abs(_std(out) / (0.02 / (2 * SMALL["n_layers"]) ** 0.5) - 1) < 0.15, _std(out)


def test_from_pretrained_initialises_only_missing_weights(tmp_path):
    """A masked-LM checkpoint loaded as a classifier: every encoder weight is the saved one,
    bit for bit; the pooler and classifier the checkpoint lacks get BERT's initialisation."""
    m = perturbed("tiny-encoder", "mhe-mul").float()
    to_hf(m).save_pretrained(tmp_path)
    clf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    own = {k.removeprefix("mhe."): v for k, v in clf.state_dict().items()}
    assert_kept({k: v for k, v in own.items() if k.startswith("encoder.")},
                {k: v for k, v in m.state_dict().items() if k.startswith("encoder.")})
    core = from_hf(clf)
    assert torch.equal(core.classifier.bias, torch.zeros(3)) and torch.equal(core.pooler[0].bias, torch.zeros(32))
    assert abs(_std(core.pooler[0].weight) / 0.02 - 1) < 0.15


@pytest.mark.parametrize("maker", ["gpt2", "bert"])
def test_import_and_export_copy_exactly_and_leave_the_source(maker):
    """``import_hf`` and ``export_hf`` copy every weight exactly (a round trip gives back every
    tensor bit for bit) and leave the model they read unchanged."""
    if maker == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=None, eos_token_id=None))
    else:
        hf = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=32))
    hf = perturb(hf.double().eval())
    before = snapshot(hf)
    ours = import_hf(hf)
    assert_kept(hf.state_dict(), before)
    ours_before = snapshot(ours)
    back = export_hf(ours)
    assert_kept(ours.state_dict(), ours_before)
    assert_kept(back.state_dict(), before)


# ---------------------------------------------------------------- run folder -> transformers
@pytest.fixture(scope="module")
def encoder_runs(tmp_path_factory):
    """A 2-step masked-LM run (tiny encoder, PTB) and a 2-step RTE classifier fine-tuned from it."""
    root = require_data("ptb/ptb.train.txt.gz", "glue/RTE/train.tsv.gz")
    tmp = tmp_path_factory.mktemp("enc")
    sets = ["train.steps=2", "train.progress=false", "train.eval_every=0", "data.limit_lines=200",
            "data.vocab_size=200", "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.max_len=32"]
    assert main(["pretrain", "--preset", "tiny-encoder", "--attention", "mhe-mul", "--data", "ptb", "--data-dir",
                 str(root), "--out", str(tmp / "mlm"), *[a for s in sets for a in ("--set", s)]]) == 0
    sets = ["train.steps=2", "train.epochs=0", "train.progress=false", "train.warmup_steps=1", "train.warmup_ratio=0",
            "train.batch_size=8", "train.eval_every=0", "train.save_every=0",
            'data.task_options={"train_limit": 16, "dev_limit": 16}']
    assert main(["finetune", "--task", "rte", "--checkpoint", str(tmp / "mlm"), "--data-dir", str(root),
                 "--out", str(tmp / "rte"), *[a for s in sets for a in ("--set", s)]]) == 0
    return {"mlm": tmp / "mlm", "classification": tmp / "rte"}


AUTO = {("decoder", "lm"): transformers.AutoModelForCausalLM, ("encoder", "mlm"): transformers.AutoModelForMaskedLM,
        ("encoder", "classification"): transformers.AutoModelForSequenceClassification,
        ("encoder-decoder", "seq2seq"): transformers.AutoModelForSeq2SeqLM}


def _round_trip(run, tmp_path):
    """run folder -> from_run -> save_pretrained -> AutoModelFor*.from_pretrained: the same
    weights, bit for bit, and the same float64 logits as the run's own model (load_run)."""
    from mhe.data.tokenize import load_tokenizer

    own = load_run(run, inference=True)[0]
    hf = from_run(run)
    tok = load_tokenizer(run)
    assert (hf.config.bos_token_id, hf.config.eos_token_id, hf.config.pad_token_id) == tuple(
        tok.token_to_id(t) for t in ("[BOS]", "[EOS]", "[PAD]"))
    hf.save_pretrained(tmp_path)
    loaded = AUTO[(own.cfg.arch, own.cfg.head)].from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert_kept({k.removeprefix("mhe."): v.float() for k, v in loaded.state_dict().items()}, snapshot(own))
    own = own.double()
    x = tuple(t.clamp(max=own.cfg.vocab_size - 1) for t in batch(own.cfg.arch, seed=5))
    torch.testing.assert_close(hf_logits(loaded, x), core_logits(own, x), **TOL)
    return hf


def test_decoder_run_round_trip(lm_run, tmp_path):
    hf = _round_trip(lm_run, tmp_path)
    assert type(hf).__name__ == "MheDecoderForCausalLM"


def test_encoder_decoder_run_round_trip(mt_run, tmp_path):
    hf = _round_trip(mt_run, tmp_path)
    assert hf.config.decoder_start_token_id == hf.config.bos_token_id


@pytest.mark.parametrize("head", ["mlm", "classification"])
def test_encoder_run_round_trip(encoder_runs, head, tmp_path):
    hf = _round_trip(encoder_runs[head], tmp_path)
    assert from_hf(hf).cfg.head == head


def test_from_run_config_overrides_win(lm_run):
    hf = from_run(lm_run, eos_token_id=3)
    assert hf.config.eos_token_id == 3 and not changed(snapshot(from_hf(hf)), snapshot(load_run(lm_run)[0]))
