"""Exported folders (``mhe.hf.export``): the standalone modeling code computes what the core
model computes, for every architecture and attention kind; the GPTBigCode export equals the
folded model; refusals name ``--format remote-code``; the exported code imports no mhe.

Runs exported through ``mhe export`` and loaded where mhe cannot be imported:
tests/hf/test_hf_export_runs.py.
"""

import ast
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from mhe.attention.folding import fold_model  # noqa: E402
from mhe.cli import main  # noqa: E402
from mhe.errors import MheError  # noqa: E402
from mhe.hf.export import REMOTE_DIR, REMOTE_FILES, save_model, to_remote, to_standard  # noqa: E402
from mhe.models import build_model  # noqa: E402
from weights_kept import perturb  # noqa: E402

SMALL = dict(vocab_size=61, d_model=32, n_heads=4, n_layers=2, d_ff=48, max_len=24)
TOL = dict(rtol=0, atol=1e-12)
DECODER_KINDS = ("mha", "mqa", "gqa", "sha", "skv", "el-att", "mhe-add", "mhe-mul")
DECODERS = ([("tiny-decoder", k, None) for k in (*DECODER_KINDS, "linear")]
            + [("llama-tiny", k, None) for k in DECODER_KINDS if not k.startswith("mhe")]
            + [("llama-tiny", k, o) for k in ("mhe-add", "mhe-mul") for o in ("rope-then-psi", "psi-then-rope")])


def perturbed(preset, kind, order=None, **kw):
    """A float64 model in eval mode whose every weight (head embeddings included) is moved
    off its initialisation, so that no factor is close to one."""
    opts = {"attn_options": {"rope_order": order}} if order else {}
    return perturb(build_model(preset, attention=kind, **{**SMALL, **opts, **kw}).double().eval())


def ids(seed=0, batch=2, length=9):
    return torch.randint(7, 61, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("preset, kind, order", DECODERS, ids=[f"{p}-{k}-{o or ''}" for p, k, o in DECODERS])
def test_decoder_logits_and_greedy_generate(preset, kind, order):
    """Float64 logits equal the core model's, and greedy generation with the static cache (and
    the dynamic one) continues the prompt token for token as the core's ``generate`` does."""
    core = perturbed(preset, kind, order)
    hf = to_remote(core)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, core(x).logits, **TOL)
        if kind == "linear":  # mixing kinds keep no cache: generation recomputes the sequence
            assert hf.config.use_cache is False
            return
        want = core.generate(x[:1], 6)
        want = getattr(want, "tokens", want)
        for cache in ("static", None):
            got = hf.generate(x[:1], max_new_tokens=6, do_sample=False, cache_implementation=cache)
            assert torch.equal(got, want), (cache, got, want)


def test_padded_decoder_batch():
    """Right padding is masked out of the keys: each row's real positions equal the row alone."""
    core = perturbed("llama-tiny", "mhe-mul")
    hf = to_remote(core)
    x = ids()
    mask = torch.ones_like(x)
    mask[1, 6:] = 0
    with torch.no_grad():
        got = hf(x, attention_mask=mask).logits
        torch.testing.assert_close(got[1, :6], hf(x[1:, :6]).logits[0], **TOL)
        torch.testing.assert_close(got, core(x, attention_mask=mask.bool()).logits, **TOL)


@pytest.mark.parametrize("preset", ["tiny-decoder", "llama-tiny"])
def test_left_padded_generate(preset):
    """A left-padded batch: each row continues as the core's ``generate`` continues it, and as the
    row does alone (positions skip the padding), with the static and the dynamic cache."""
    core = perturbed(preset, "mhe-mul")
    hf = to_remote(core)
    x, mask = ids(length=7), torch.ones(2, 7, dtype=torch.long)
    x[0, :3], mask[0, :3] = 0, 0
    with torch.no_grad():
        want = core.generate(x, 5, attention_mask=mask.bool(), pad_id=0)
        want = getattr(want, "tokens", want)
        alone = hf.generate(x[:1, 3:], max_new_tokens=5, do_sample=False)
        for cache in ("static", None):
            got = hf.generate(x, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                              cache_implementation=cache)
            assert torch.equal(got, want) and torch.equal(got[0, 3:], alone[0]), (cache, got, want, alone)


def test_decoder_classifier_logits():
    core = perturbed("tiny-decoder", "mhe-mul", head="classification", num_labels=3)
    hf = to_remote(core)
    x, mask = ids(), torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        torch.testing.assert_close(hf(x, attention_mask=mask).logits, core(x, mask.bool()).logits, **TOL)


ENCODERS = [(head, kind) for head in ("mlm", "classification", "qa") for kind in ("mha", "mhe-mul", "fnet")]


@pytest.mark.parametrize("head, kind", ENCODERS, ids=[f"{h}-{k}" for h, k in ENCODERS])
def test_encoder_logits(head, kind):
    core = perturbed("tiny-encoder", kind, head=head)
    hf = to_remote(core)
    x = ids()
    mask = torch.ones_like(x)
    mask[0, 5:] = 0
    with torch.no_grad():
        out = hf(x, attention_mask=mask)
        got = torch.stack([out.start_logits, out.end_logits], -1) if head == "qa" else out.logits
        torch.testing.assert_close(got, core(x, mask.bool()).logits, **TOL)


@pytest.mark.parametrize("kind", ["mha", "mhe-mul", "mhe-add"])
def test_seq2seq_logits_and_greedy_generate(kind):
    """Teacher-forced logits equal the core's; greedy generation (static cache) equals greedy
    decoding with the core's own ``encode``/``decode``."""
    core = perturbed("tiny-encoder-decoder", kind)
    hf = to_remote(core, decoder_start_token_id=5)
    src, tgt = ids(), ids(1, length=6)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=src, decoder_input_ids=tgt).logits, core(src, tgt).logits, **TOL)
        want = torch.tensor([[5]])
        memory = core.encode(src[:1])
        for _ in range(6):
            want = torch.cat([want, core.decode(want, memory)[:, -1].argmax(-1, keepdim=True)], 1)
        got = hf.generate(src[:1], max_new_tokens=6, do_sample=False, cache_implementation="static")
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("kind", ["mqa", "mhe-mul", "mhe-add"])
def test_gptbigcode_equals_the_folded_model(kind, tmp_path):
    """``--format standard`` of a GPT-2-style mqa or MHE decoder: a GPTBigCodeForCausalLM
    (multi_query) that, saved and loaded by transformers alone, gives the folded model's logits."""
    core = perturbed("tiny-decoder", kind)
    folded = fold_model(copy.deepcopy(core)).eval()
    save_model(core, tmp_path / "out", format="standard")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    assert type(loaded).__name__ == "GPTBigCodeForCausalLM" and loaded.config.multi_query
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, folded(x).logits, **TOL)
        torch.testing.assert_close(loaded(x).logits, core(x).logits, rtol=0, atol=1e-11)


@pytest.mark.parametrize("preset, kind", [("llama-tiny", "mhe-mul"), ("tiny-decoder", "skv"),
                                          ("llama-tiny", "el-att"), ("tiny-encoder-decoder", "mha")])
def test_standard_refused_where_none_fits(preset, kind):
    with pytest.raises(MheError, match="use --format remote-code$"):
        to_standard(perturbed(preset, kind))


def test_cli_standard_export_of_a_run(lm_run, tmp_path, capsys):
    """``mhe export --format standard`` of the GPT-2-style MHE-Mul run: a GPTBigCode folder that
    transformers loads without remote code, with the run's tokenizer and the folded run's logits; a second
    export into the same folder is refused in one line (exit 2) and leaves it as it was."""
    from mhe.tasks.runs import load_run

    out = tmp_path / "out"
    assert main(["export", "--run", str(lm_run), "--out", str(out), "--format", "standard"]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert type(model).__name__ == "GPTBigCodeForCausalLM" and (out / "README.md").is_file()
    folded = fold_model(load_run(lm_run, inference=True)[0]).double()  # folded in the run's float32, as exported
    assert model.config.eos_token_id == tok.convert_tokens_to_ids("[EOS]")
    x = torch.tensor([tok("the company said it will")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, folded(x).logits, **TOL)
    files = sorted(p.name for p in out.iterdir())
    capsys.readouterr()
    assert main(["export", "--run", str(lm_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not an empty folder" in err[0]
    assert sorted(p.name for p in out.iterdir()) == files


def test_save_refuses_a_folder_with_files(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(MheError, match="not an empty folder"):
        save_model(perturbed("tiny-decoder", "mha"), tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_remote_code_imports_only_torch_and_transformers():
    """The files an exported folder carries import torch, transformers, the standard library and
    each other (relative imports): never mhe."""
    allowed = {"torch", "transformers", "math", "dataclasses", "__future__"}
    for name in REMOTE_FILES:
        tree = ast.parse((REMOTE_DIR / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                roots = set() if node.level else {node.module.split(".")[0]}
            else:
                continue
            assert roots <= allowed, (name, roots)


def test_from_run_folder_carries_the_tokenizer(lm_run, tmp_path):
    """``mhe.hf.from_run(run).save_pretrained(folder)``: ``AutoTokenizer`` loads the folder (the
    run's own tokenizer, its vocabulary unchanged) as ``AutoModelForCausalLM`` does."""
    import mhe.hf
    from mhe.data.tokenize import load_tokenizer

    mhe.hf.from_run(lm_run).save_pretrained(tmp_path / "run")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "run")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    own = load_tokenizer(lm_run)
    assert len(tok) == own.get_vocab_size() == model.config.vocab_size
    assert tok("the company said")["input_ids"] == own.encode("the company said").ids
    assert (tok.eos_token, tok.pad_token) == ("[EOS]", "[PAD]")


def test_export_hf_with_tokenizer(lm_run, tmp_path):
    """``export_hf(model, tokenizer=tok).save_pretrained(folder)`` writes the tokenizer too, with
    its end and padding ids in the config."""
    from mhe.data.tokenize import load_tokenizer
    from mhe.hf import export_hf

    tok = load_tokenizer(lm_run)
    export_hf(perturbed("llama-tiny", "gqa", vocab_size=tok.get_vocab_size()), tokenizer=tok).save_pretrained(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    assert loaded("the company said")["input_ids"] == tok.encode("the company said").ids
    assert (config.eos_token_id, config.bos_token_id) == (tok.token_to_id("[EOS]"), tok.token_to_id("[BOS]"))
