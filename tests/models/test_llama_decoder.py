"""The Llama-style decoder (RMSNorm, SwiGLU, rotary positions, grouped K/V) with every attention kind
that has a cache: cached decoding equals uncached, compiled steps equal eager ones, the cache
holds the kind's heads, and what runs on a decoder runs on it (training, checkpoints and resume,
eval, generate, fine-tuning, the Hugging Face adapter)."""

import json

import pytest
import torch

from conftest import require_data
from mhe.attention import KINDS, attention_class
from mhe.cli import main
from mhe.errors import MheError
from mhe.models import build_model, preset
from reference import generate_uncached

ROTARY_KINDS = [k for k in KINDS if attention_class(k).supports_cache]
VARIANTS = ROTARY_KINDS + ["mhe-mul psi-then-rope", "mhe-add psi-then-rope"]
SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=48, n_layers=2, max_len=40)
AOT = {"backend": "aot_eager"}


def llama(variant, **kw):
    kind, _, order = variant.partition(" ")
    opts = {"n_kv_heads": 2} if kind == "gqa" else {"rope_order": order} if order else {}
    model = build_model("llama-tiny", attention=kind, attn_options=opts, **{**SMALL, **kw}).double().eval()
    with torch.no_grad():  # MHE head embeddings far from zero: the identities matter
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)
    return model


def left_padded():
    ids = torch.randint(3, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("variant", VARIANTS)
def test_cached_decode_equals_uncached_and_the_cache_holds_the_kinds_heads(variant):
    model = llama(variant)
    ids, mask = left_padded()
    session = model.generator(2, 14)
    tokens, cached = model.generate(ids, 8, attention_mask=mask, return_logits=True, session=session)
    again, full = generate_uncached(model, ids, 8, attention_mask=mask, return_logits=True)
    assert torch.equal(tokens, again)
    torch.testing.assert_close(cached, full, rtol=1e-12, atol=1e-12)
    kind, _, order = variant.partition(" ")
    want = {"mha": 4, "skv": 4, "el-att": 4, "gqa": 2}.get(kind, 4 if order == "psi-then-rope" else 1)
    assert {c.k.shape[1] for c in session.caches} == {want}
    if kind.startswith("mhe"):  # never folded under rotary positions: the view keeps MHE itself
        assert {type(layer.self_attn).__name__ for layer in session.view.decoder.layers} == {type(
            model.decoder.layers[0].self_attn).__name__}


@pytest.mark.parametrize("variant", [v if v == "mhe-mul" else pytest.param(v, marks=pytest.mark.slow)
                                     for v in VARIANTS])
def test_compiled_decode_equals_eager_and_compiles_once(variant):
    model = llama(variant)
    ids, mask = left_padded()
    want, want_logits = model.generate(ids, 12, attention_mask=mask, step_mode="eager", return_logits=True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    session = model.generator(2, 18, step_mode="compile", compile_options=AOT)
    got, logits = model.generate(ids, 12, attention_mask=mask, return_logits=True, session=session)
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == 2  # the step and the greedy choice
    assert torch.equal(got, want)
    torch.testing.assert_close(logits, want_logits, rtol=1e-12, atol=1e-12)


def test_positions_are_rotary_only():
    """No learned position table, positions past max_len are refused in one line, and moving a
    token changes the logits (the rotation carries the order)."""
    model = llama("gqa")
    assert not any("positions" in name for name, _ in model.named_parameters())
    with pytest.raises(MheError, match="max_len"):
        model(torch.randint(3, 99, (1, 41)))
    ids = torch.randint(3, 99, (1, 6))
    swapped = ids[:, [1, 0, 2, 3, 4, 5]]
    assert not torch.allclose(model(ids).logits[0, -1], model(swapped).logits[0, -1])


def test_presets_are_the_public_models_shapes():
    small, big = preset("llama-135m"), preset("llama-1.1b")
    assert (small.n_layers, small.d_model, small.n_heads, small.attn_options.n_kv_heads, small.d_ff,
            small.vocab_size, small.tie_embeddings) == (30, 576, 9, 3, 1536, 49152, True)
    assert (big.n_layers, big.d_model, big.n_heads, big.attn_options.n_kv_heads, big.d_ff, big.vocab_size,
            big.tie_embeddings) == (22, 2048, 32, 4, 5632, 32000, False)
    for cfg in (small, big):
        assert (cfg.norm, cfg.mlp, cfg.positions, cfg.rope_base, cfg.layer_norm_eps) == \
            ("rmsnorm", "swiglu", "rotary", 10000.0, 1e-5)
    for kind in ("fnet", "linear"):
        with pytest.raises(MheError, match="rotary"):
            build_model("llama-tiny", attention=kind)


def test_training_steps_lower_the_loss():
    torch.manual_seed(0)
    model = build_model("llama-tiny", attention="mhe-mul", **SMALL)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(3, 99, (4, 16))
    first = None
    for _ in range(15):
        loss = model(ids, labels=ids).loss
        first = first if first is not None else loss.item()
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert loss.item() < 0.8 * first  # from ln(99) = 4.6


def test_exact_resume_gives_identical_losses(tmp_path):
    """Stopped at a checkpoint and resumed: the same loss at every step as straight through."""
    from mhe.tasks.recall import RecallTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.loop import Trainer

    items = ['data.task_options={"train_size": 128, "test_size": 32, "pairs": 4, "queries": 4}', "train.steps=8",
             "train.batch_size=16", "train.log_every=1", "train.save_every=4", "train.progress=false",
             "model.dropout=0.1", "model.d_model=32", "model.d_ff=48", "model.n_layers=1"]
    run = lambda extra=(): apply_overrides(default_run("recall", "llama-tiny", "mhe-mul"), items + list(extra))  # noqa: E731
    Trainer(run(), RecallTask(), tmp_path / "a", log=lambda *_: None).fit()
    assert Trainer(run(["train.stop_at=4"]), RecallTask(), tmp_path / "b", log=lambda *_: None).fit()["step"] == 4
    Trainer(run(), RecallTask(), tmp_path / "b", resume=True, log=lambda *_: None).fit()
    a, b = ([json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in "ab")
    assert len(a) == 8 and a == b


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """``mhe pretrain --preset llama-tiny`` (MHE-Mul), 4 steps on 300 PTB lines."""
    root = require_data("ptb/ptb.train.txt.gz")
    out = tmp_path_factory.mktemp("llama") / "run"
    assert main(["pretrain", "--preset", "llama-tiny", "--attention", "mhe-mul", "--data", "ptb", "--data-dir",
                 str(root), "--out", str(out), "--set", "train.steps=4", "--set", "train.progress=false",
                 "--set", "data.limit_lines=300", "--set", "data.vocab_size=300", "--set", "train.save_every=2",
                 "--set", "train.eval_every=2", "--set", "model.max_len=32"]) == 0
    return out, root


def test_a_pretrained_run_evaluates_generates_and_fine_tunes(llama_run, tmp_path, capsys):
    out, root = llama_run
    cfg = json.loads((out / "config.json").read_text())["run"]["model"]
    assert (cfg["positions"], cfg["norm"], cfg["mlp"], cfg["attention"]) == ("rotary", "rmsnorm", "swiglu", "mhe-mul")
    capsys.readouterr()
    assert main(["eval", "--task", "lm", "--checkpoint", str(out), "--split", "valid", "--stride", "16"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1
    assert main(["generate", "--checkpoint", str(out), "--prompt", "the company", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out.startswith("the company ")
    glue = require_data("glue/MRPC/train.tsv.gz")
    tiny = ["train.steps=2", "train.epochs=0", "train.progress=false", "train.warmup_steps=1", "train.warmup_ratio=0",
            "train.batch_size=8", "train.eval_every=0", "train.save_every=0",
            'data.task_options={"train_limit": 16, "dev_limit": 16}']
    assert main(["finetune", "--task", "mrpc", "--checkpoint", str(out), "--data-dir", str(glue),
                 "--out", str(tmp_path / "ft"), *sum((["--set", s] for s in tiny), [])]) == 0
    ft = json.loads((tmp_path / "ft" / "config.json").read_text())["model"]  # the model that was trained
    assert ft["head"] == "classification" and ft["positions"] == "rotary"


@pytest.mark.slow
def test_pretrain_llama_tiny_on_wikitext2_lowers_the_loss(tmp_path):
    """``mhe pretrain --preset llama-tiny --data wikitext-2`` (the CPU schedule: word level, adaptive
    softmax), shortened to 60 steps on 1,000 lines a split: the logged loss falls well below its start."""
    root = require_data("wikitext-2/wiki.train.tokens.xz", "wikitext-2/wiki.valid.tokens.gz",
                        "wikitext-2/wiki.test.tokens.gz")
    out = tmp_path / "run"
    assert main(["pretrain", "--preset", "llama-tiny", "--attention", "mhe-mul", "--data", "wikitext-2",
                 "--data-dir", str(root), "--out", str(out), "--set", "train.steps=60", "--set", "train.log_every=10",
                 "--set", "train.warmup_steps=6", "--set", "data.limit_lines=1000",
                 "--set", "train.progress=false"]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if "loss" in json.loads(line)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses
    assert json.loads((out / "results.json").read_text())["perplexity"] > 1
