"""``mhe export`` of trained runs, loaded where mhe cannot be imported.

Tiny runs (a Llama-style MHE-Mul decoder in both rotary orders, a GPT-2-style MHA decoder, a
masked-LM encoder and the shared translation run of tests/tiny_runs.py) are exported with
``mhe export``; one subprocess, in which ``import mhe`` fails, loads every folder with
transformers' ``AutoTokenizer`` and ``AutoModelFor*`` (``trust_remote_code=True``) and computes
float64 logits and greedy continuations with the static cache. They must equal the run's own
model (``load_run``): logits to 1e-9, tokens one for one.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
from conftest import require_data  # noqa: E402
from mhe.cli import main  # noqa: E402
from mhe.data.tokenize import load_tokenizer  # noqa: E402
from mhe.tasks.runs import load_run  # noqa: E402

pytestmark = pytest.mark.slow  # trains four tiny runs and starts one Python with transformers (~40 s)

TOL = dict(rtol=0, atol=1e-9)
NEW = 8
TRAIN = ["train.steps=2", "train.eval_every=2", "train.progress=false", "data.limit_lines=200",
         "train.batch_size=4", "model.n_layers=1", "model.d_model=32", "model.d_ff=64", "model.max_len=32"]
AUTO = {"decoder": "AutoModelForCausalLM", "encoder": "AutoModelForMaskedLM",
        "encoder-decoder": "AutoModelForSeq2SeqLM"}

# the subprocess: mhe made unimportable before anything else runs
LOADER = r"""
import json, sys
sys.modules["mhe"] = None
try:
    import mhe  # noqa: F401
    raise SystemExit("mhe is importable")
except ImportError:
    pass
import torch, transformers
torch.set_num_threads(1)
jobs, results = json.load(open(sys.argv[1])), {}
for name, job in jobs.items():
    tok = transformers.AutoTokenizer.from_pretrained(job["folder"])
    model = getattr(transformers, job["auto"]).from_pretrained(job["folder"], trust_remote_code=True,
                                                               dtype=torch.float64).eval()
    ids = torch.tensor([tok(job["text"])["input_ids"]])
    out = {"ids": ids, "module": type(model).__module__}
    with torch.no_grad():
        if job["auto"] == "AutoModelForSeq2SeqLM":
            out["logits"] = model(input_ids=ids, decoder_input_ids=ids[:, :5]).logits
        else:
            out["logits"] = model(ids).logits
        if job["auto"] != "AutoModelForMaskedLM":
            out["generated"] = model.generate(ids, max_new_tokens=job["new"], do_sample=False,
                                              cache_implementation="static")
        else:  # a pre-trained encoder also starts a classifier (its head untrained)
            cls = transformers.AutoModelForSequenceClassification.from_pretrained(job["folder"], trust_remote_code=True)
            out["classifier_logits"] = cls(ids).logits
    results[name] = out
torch.save(results, sys.argv[2])
"""


def _train(out, *args):
    assert main([*args, "--out", str(out), *[a for s in TRAIN for a in ("--set", s)]]) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mt_run):
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    tmp = tmp_path_factory.mktemp("export-runs")
    lm = ["train", "--task", "lm", "--data", "ptb", "--data-dir", str(root)]
    return {
        "llama-mhe-mul": _train(tmp / "llama", *lm, "--preset", "llama-tiny", "--attention", "mhe-mul"),
        "llama-mhe-mul-psi-first": _train(tmp / "llama-psi", *lm, "--preset", "llama-tiny", "--attention", "mhe-mul",
                                          "--set", 'model.attn_options={"rope_order": "psi-then-rope"}'),
        "gpt2-mha": _train(tmp / "gpt2", *lm, "--preset", "tiny-decoder", "--attention", "mha"),
        "encoder": _train(tmp / "mlm", "pretrain", "--preset", "tiny-encoder", "--attention", "mhe-mul", "--data",
                          "ptb", "--data-dir", str(root), "--set", "data.vocab_size=200"),
        "translation": mt_run,
    }


TEXT = {"translation": "a man rides a bike .", "encoder": "the company said it [MASK] sell"}


@pytest.fixture(scope="module")
def loaded(runs, tmp_path_factory):
    """Every run exported with ``mhe export``, then loaded and run in one Python without mhe."""
    tmp = tmp_path_factory.mktemp("exported")
    jobs = {}
    for name, run in runs.items():
        assert main(["export", "--run", str(run), "--out", str(tmp / name)]) == 0
        arch = load_run(run, inference=True)[1].model.arch
        jobs[name] = {"folder": str(tmp / name), "auto": AUTO[arch], "new": NEW,
                      "text": TEXT.get(name, "the company said it will")}
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp / "modules"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", LOADER, str(tmp / "jobs.json"), str(tmp / "out.pt")], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**torch.load(tmp / "out.pt"), "folder": tmp}


def _finish(tokens, prompt: int, eos: int, pad: int):
    """Greedy tokens as ``generate`` returns them: after the first end token, padding."""
    out = tokens.clone()
    hits = (out[0, prompt:] == eos).nonzero()
    if len(hits):
        out[0, prompt + int(hits[0]) + 1:] = pad
    return out


@pytest.mark.parametrize("name", ["llama-mhe-mul", "llama-mhe-mul-psi-first", "gpt2-mha"])
def test_decoder_run_loads_without_mhe(name, runs, loaded):
    got = loaded[name]
    assert not got["module"].startswith("mhe")
    core, cfg, _ = load_run(runs[name], inference=True)
    core = core.double()
    tok = load_tokenizer(runs[name])
    ids = got["ids"]
    assert ids[0].tolist() == tok.encode("the company said it will").ids  # AutoTokenizer: the run's tokenizer
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], core(ids).logits, **TOL)
        eos, pad = tok.token_to_id("[EOS]"), tok.token_to_id("[PAD]")
        want = core.generate(ids, NEW, stop_ids=[eos], pad_id=pad)
    assert torch.equal(got["generated"], getattr(want, "tokens", want))


def test_encoder_run_loads_without_mhe(runs, loaded):
    got = loaded["encoder"]
    core = load_run(runs["encoder"], inference=True)[0].double()
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], core(got["ids"]).logits, **TOL)
    assert got["classifier_logits"].shape == (1, 2)


def test_translation_run_loads_without_mhe(runs, loaded):
    got = loaded["translation"]
    core = load_run(runs["translation"], inference=True)[0].double()
    tok = load_tokenizer(runs["translation"])
    ids = got["ids"]
    bos, eos, pad = (tok.token_to_id(t) for t in ("[BOS]", "[EOS]", "[PAD]"))
    with torch.no_grad():
        torch.testing.assert_close(got["logits"], core(ids, ids[:, :5]).logits, **TOL)
        want, memory = torch.tensor([[bos]]), core.encode(ids)
        for _ in range(NEW):
            want = torch.cat([want, core.decode(want, memory)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(got["generated"], _finish(want, 1, eos, pad)[:, :got["generated"].shape[1]])


def test_model_card(runs, loaded):
    """The card names the architecture, the attention kind and rotary order, the parameters by
    part (summing to the model's), the KV cache per token, the tokenizer and the run's scores with
    their unit (issue 58)."""
    text = (loaded["folder"] / "llama-mhe-mul" / "README.md").read_text()
    core = load_run(runs["llama-mhe-mul"], inference=True)[0]
    total = sum(p.numel() for p in core.parameters())
    results = json.loads((runs["llama-mhe-mul"] / "results.json").read_text())
    for want in ("Llama-style decoder", "mhe-mul", "rotary order rope-then-psi", f"| total | {total:,} |",
                 "32 bytes per token in bf16/fp16 (keys and values: 1 layer x 1 K/V head x 8)",
                 f"| perplexity (per {results['perplexity_per']}) | {results['perplexity']:.6g} |",
                 f"| tokenizer | {results['tokenizer']} |",
                 f"measured with the run's tokenizer ({results['tokenizer']})"):
        assert want in text, want
    psi_first = (loaded["folder"] / "llama-mhe-mul-psi-first" / "README.md").read_text()
    assert "rotary order psi-then-rope" in psi_first and "1 layer x 4 K/V heads x 8" in psi_first


def test_standard_format_refused_for_rotary_mhe(runs, tmp_path, capsys):
    assert main(["export", "--run", str(runs["llama-mhe-mul"]), "--out", str(tmp_path / "o"),
                 "--format", "standard"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("use --format remote-code") and not (tmp_path / "o").exists()
