"""``mhe eval --harness``: EleutherAI's lm-evaluation-harness on exported mhe runs, offline.

Two tiny runs (a Llama-style MHE-Mul decoder on PTB, word level, and a GPT-2-style MHA decoder
on WikiText-2 with byte-level BPE) are scored through the documented command with the shipped
offline tasks on two documents each. The cross-check: every document's rolling log-likelihood
from the harness equals mhe's sliding-window NLL (:func:`mhe.metrics.perplexity.sliding_window_nll`,
what ``mhe eval`` sums) over the same windows, the word and byte perplexities follow from it
when words and bytes are counted the harness's way, and each multiple-choice answer's
log-likelihood equals the run's own model's on the same tokens.
"""

import contextlib
import importlib.util
import io
import json
import math
import os
import re
import sys

import pytest
import torch

from conftest import require_data
from mhe.cli import main
from mhe.data.tokenize import load_tokenizer
from mhe.harness import TASKS_DIR
from mhe.harness.evaluate import OFFLINE_TASKS
from mhe.metrics.perplexity import sliding_window_nll
from mhe.tasks.runs import load_run

WINDOW = 32  # the tiny runs' model window
HARNESS_WINDOW = WINDOW - 1  # --max-length: the harness's L inputs predict L tokens, mhe's window L-1
TRAIN = ["--set", "train.steps=3", "--set", "train.eval_every=3", "--set", "train.progress=false",
         "--set", "data.limit_lines=200", "--set", "train.batch_size=4", "--set", "model.n_layers=1",
         "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", f"model.max_len={WINDOW}"]
TASKS = "mhe_ptb,mhe_wikitext2,mhe_rte,mhe_copa"
LIMIT = 2
DATA = ("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz", "wikitext-2/wiki.train.tokens.xz",
        "wikitext-2/wiki.valid.tokens.gz", "wikitext-2/wiki.test.tokens.gz", "superglue/RTE/val.jsonl.gz",
        "superglue/COPA/val.jsonl", "superglue/CB/val.jsonl", "superglue/WiC/val.jsonl.gz")


@pytest.fixture(scope="module", autouse=True)
def offline():
    """No network: datasets and the hub client offline (also where they were imported already)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        for module, name in (("datasets.config", "HF_DATASETS_OFFLINE"),
                             ("huggingface_hub.constants", "HF_HUB_OFFLINE")):
            if module in sys.modules:
                mp.setattr(sys.modules[module], name, True)
        yield


def require(package: str) -> None:
    """Skip without ``package`` (an optional extra), but fail under CI, whose ``test`` extra has it."""
    if importlib.util.find_spec(package) is None:
        message = f"{package} is not installed (pip install 'mhe[eval]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


def loaders():
    """The shipped task loaders, imported by path as the harness imports them."""
    spec = importlib.util.spec_from_file_location("mhe_loaders", TASKS_DIR / "mhe_loaders.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_offline_tasks_read_the_project_data():
    """Each task's documents, read from the data folder with no download: counts of the stored
    splits (MANIFEST.md), the first document's text and the labels' spread."""
    require("datasets")
    root = require_data(*DATA)
    m = loaders()
    wiki = m.wikitext2(data_dir=str(root))
    assert len(wiki["test"]) == 62 and len(wiki["validation"]) == 60
    assert wiki["test"][0]["page"].startswith("= Robert <unk> =\nRobert <unk> is an English film ,")
    ptb = m.ptb(data_dir=str(root))
    assert len(ptb["test"]) == 76  # 3,761 sentences in blocks of 50
    assert ptb["test"][0]["page"].split("\n")[:2] == ["no it was n't black monday",
                                                      "but while the new york stock exchange did n't fall apart "
                                                      "friday as the dow jones industrial average plunged N points "
                                                      "most of it in the final hour it barely managed to stay this "
                                                      "side of chaos"]
    spread = {name: [int(sum(1 for r in getattr(m, name)(data_dir=str(root))["validation"] if r["gold"] == k))
                     for k in range(3)] for name in ("rte", "cb", "copa", "wic")}
    assert spread == {"rte": [146, 131, 0], "cb": [23, 28, 5], "copa": [55, 45, 0], "wic": [319, 319, 0]}
    copa = m.copa(data_dir=str(root))["validation"][0]
    assert copa["query"] == "The man turned on the faucet so"
    assert copa["choices"] == [" the toilet filled with water.", " water flowed from the spout."]


def test_harness_refusals(lm_run, capsys):
    """Bad --harness input: one line, exit 2, nothing written in the run folder."""
    before = sorted(p.name for p in lm_run.iterdir())
    for args, said in ((["--harness", " , "], "--harness needs task names"),
                       (["--harness", "mhe_ptb", "--limit", "0"], "--limit must be a positive"),
                       (["--harness", "mhe_ptb", "--max-length", "0"], "--max-length must be a positive"),
                       (["--harness", "mhe_ptb", "--stride", "8"], "--stride 8 is mhe's own evaluation"),
                       (["--harness", "mhe_ptb", "--split", "valid"], "--split valid is mhe's own evaluation"),
                       (["--limit", "2"], "--limit applies to --harness TASKS only"),
                       (["--harness", "mhe_ptb", "--out", "no-such-folder/x.json"], "--out")):
        assert main(["eval", "--run", str(lm_run), *args]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in lm_run.iterdir()) == before


def test_missing_harness_names_the_extra(lm_run, capsys, monkeypatch):
    from mhe.harness import evaluate

    real = importlib.util.find_spec
    monkeypatch.setattr(evaluate.importlib.util, "find_spec", 
                        lambda name, *rest: None if name == "lm_eval" else real(name, *rest))
    assert main(["eval", "--run", str(lm_run), "--harness", "mhe_ptb"]) == 2
    assert "pip install 'mhe[eval]'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """The two runs, each scored by ``mhe eval --harness`` (its printed table and saved files)."""
    require("lm_eval")
    root = require_data(*DATA)
    tmp = tmp_path_factory.mktemp("harness")
    runs = {"llama-mhe-mul": ["--data", "ptb", "--preset", "llama-tiny", "--attention", "mhe-mul"],
            "gpt2-mha": ["--data", "wikitext-2", "--preset", "tiny-decoder", "--attention", "mha",
                         "--set", "data.tokenizer=bpe", "--set", "data.vocab_size=400"]}
    out = {}
    for name, args in runs.items():
        run = tmp / name
        assert main(["train", "--task", "lm", *args, "--data-dir", str(root), "--out", str(run), *TRAIN]) == 0
        copy = tmp / f"{name}.json"
        printed = _capture(["eval", "--run", str(run), "--harness", TASKS, "--limit", str(LIMIT), "--device", "cpu",
                            "--max-length", str(HARNESS_WINDOW), "--data-dir", str(root), "--out", str(copy)])
        out[name] = {"run": run, "printed": printed, "saved": json.loads((run / "harness-results.json").read_text()),
                     "table": (run / "harness-results.md").read_text(), "out": json.loads(copy.read_text())}
    return out, root


def _capture(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(argv) == 0
    return buf.getvalue()


def mhe_rolling_nll(model, ids: list[int], prefix: int, window: int) -> tuple[float, int]:
    """NLL of ``ids`` from mhe's sliding-window scorer over the harness's windows: ``[prefix] + ids``
    at stride ``window`` (windows of ``window + 1`` tokens, each scoring ``window``), and the
    last partial window, which the harness fills with earlier tokens, as the difference of
    two windows ending at the same place."""
    stream = torch.tensor([prefix] + ids)
    n, whole = len(ids), len(ids) // window * window
    if whole == 0:
        return sliding_window_nll(model, stream, max_len=window + 1, stride=window)
    nll, count = sliding_window_nll(model, stream[:whole + 1], max_len=window + 1, stride=window)
    rest = n - whole
    if rest:
        last, scored = sliding_window_nll(model, stream[n - window:], max_len=window + 1, stride=window)
        before, less = sliding_window_nll(model, stream[n - window:n + 1 - rest], max_len=window + 1, stride=window)
        nll, count = nll + last - before, count + scored - less
    return nll, count


def mhe_choice_loglikelihood(model, tok, context: str, choice: str, window: int) -> float:
    """Log-likelihood of ``choice`` after ``context`` from the run's own model, on the tokens the
    harness scores (the whole text's tokens after the context's; at most ``window`` inputs)."""
    ctx = tok.encode(context, add_special_tokens=False).ids
    whole = tok.encode(context + choice, add_special_tokens=False).ids
    cont = whole[len(ctx):]
    seq = torch.tensor((ctx + cont)[-(window + 1):])
    with torch.no_grad():
        logp = model(seq[None, :-1]).logits[0].float().log_softmax(-1)
    return float(logp[-len(cont):].gather(-1, seq[-len(cont):, None]).sum())


SLOW = pytest.mark.slow  # trains two tiny runs and runs the harness on each (about a minute on one core)


@SLOW
@pytest.mark.parametrize("name", ["llama-mhe-mul", "gpt2-mha"])
def test_harness_rolling_loglikelihood_equals_mhe(name, scored):
    out, root = scored
    got = out[name]
    model = load_run(got["run"], inference=True)[0].eval()
    tok = load_tokenizer(got["run"])
    eos = tok.token_to_id("[EOS]")
    m = loaders()
    for task, docs in (("mhe_ptb", m.ptb(data_dir=str(root))["test"]),
                       ("mhe_wikitext2", m.wikitext2(data_dir=str(root))["test"])):
        scores = got["saved"]["documents"][task]
        assert [s["doc_id"] for s in scores] == list(range(LIMIT))
        nll = words = nbytes = 0.0
        for s in scores:
            text = docs[s["doc_id"]]["page"]
            ids = tok.encode(text, add_special_tokens=False).ids
            doc_nll, count = mhe_rolling_nll(model, ids, eos, HARNESS_WINDOW)
            assert count == len(ids) > 2 * HARNESS_WINDOW  # several windows, every token scored once
            harness_ll, = s["loglikelihoods"]
            assert -harness_ll == pytest.approx(doc_nll, rel=1e-7), (task, s["doc_id"])
            nll += doc_nll
            words += len(re.split(r"\s+", text))
            nbytes += len(text.encode("utf-8"))
        res = got["saved"]["results"][task]
        assert res["word_perplexity,none"] == pytest.approx(math.exp(nll / words), rel=1e-5)
        assert res["byte_perplexity,none"] == pytest.approx(math.exp(nll / nbytes), rel=1e-5)
        assert res["bits_per_byte,none"] == pytest.approx(nll / nbytes / math.log(2), rel=1e-5)


@SLOW
@pytest.mark.parametrize("name", ["llama-mhe-mul", "gpt2-mha"])
def test_harness_choices_equal_mhe(name, scored):
    out, root = scored
    got = out[name]
    model = load_run(got["run"], inference=True)[0].eval()
    tok = load_tokenizer(got["run"])
    m = loaders()
    for task, fn in (("mhe_rte", m.rte), ("mhe_copa", m.copa)):
        docs = fn(data_dir=str(root))["validation"]
        correct = 0
        for s in got["saved"]["documents"][task]:
            doc = docs[s["doc_id"]]
            mine = [mhe_choice_loglikelihood(model, tok, doc["query"], c, HARNESS_WINDOW) for c in doc["choices"]]
            assert s["loglikelihoods"] == pytest.approx(mine, rel=1e-6, abs=1e-6), (task, s["doc_id"])
            correct += max(range(len(mine)), key=mine.__getitem__) == doc["gold"]
        assert got["saved"]["results"][task]["acc,none"] == correct / LIMIT


@SLOW
def test_unknown_harness_task_is_refused(lm_run, capsys):
    require("lm_eval")
    before = sorted(p.name for p in lm_run.iterdir())
    assert main(["eval", "--run", str(lm_run), "--harness", "mhe_ptb,no_such_task"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("mhe eval: error: --harness: no task 'no_such_task'; the offline ones are mhe_offline, "
                       "mhe_wikitext2, mhe_ptb, mhe_rte, mhe_cb, mhe_copa, mhe_wic (or name any task lm-eval knows)")
    assert sorted(p.name for p in lm_run.iterdir()) == before


def test_shipped_tasks_are_the_named_ones():
    assert sorted(p.stem for p in TASKS_DIR.glob("*.yaml")) == sorted(OFFLINE_TASKS[1:])


@SLOW
@pytest.mark.parametrize("name", ["llama-mhe-mul", "gpt2-mha"])
def test_harness_table_printed_and_saved(name, scored):
    got = scored[0][name]
    table = got["table"]
    assert got["printed"].startswith(table)
    for task in TASKS.split(","):
        assert re.search(rf"^\|{task}\s*\|", table, re.M), task
    ptb = got["saved"]["results"]["mhe_ptb"]["word_perplexity,none"]
    assert f"{ptb:.4f}" in table
    assert got["out"] == got["saved"]  # --out: the same JSON
    assert got["saved"]["lm_eval_version"] == "0.4.13"
    assert got["saved"]["n-samples"]["mhe_ptb"]["effective"] == LIMIT
    assert not [p.name for p in got["run"].iterdir() if p.name.startswith(".")]  # no partial file left


@SLOW
def test_harness_refuses_a_translation_run(mt_run, capsys):
    require("lm_eval")
    assert main(["eval", "--run", str(mt_run), "--harness", "mhe_ptb", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"mhe eval: error: --harness scores language models (decoder runs); {mt_run} exports as " \
                  "AutoModelForSeq2SeqLM"
    assert not list(mt_run.glob("harness-results*"))


@SLOW
def test_harness_table_scores_a_comparison_in_worker_processes(scored, tmp_path, monkeypatch):
    """``benchmarks/harness_table.py --workers 2`` on a comparison folder of the two runs: each run
    scored in a spawned process gives the harness's numbers that ``mhe eval --harness`` gave in
    this one (same documents, windows and weights), beside the run's own ``results.json``."""
    import shutil

    out, root = scored
    bench = TASKS_DIR.parents[3] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("harness_table", bench / "harness_table.py")
    tool = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "harness_table", tool)
    spec.loader.exec_module(tool)
    for name, got in out.items():  # a copy: the tool writes its results in each run folder
        shutil.copytree(got["run"], tmp_path / "cmp" / "runs" / f"{name}-seed0")
    assert tool.main([str(tmp_path / "cmp"), "--tasks", "mhe_ptb,mhe_rte", "--limit", str(LIMIT), "--device", "cpu",
                      "--max-length", str(HARNESS_WINDOW), "--data-dir", str(root), "--workers", "2",
                      "--out", str(tmp_path / "table")]) == 0
    saved = json.loads((tmp_path / "table" / "harness.json").read_text())
    rows = {r["kind"]: r for r in saved["rows"]}
    assert sorted(rows) == sorted(out) and saved["max_length"] == HARNESS_WINDOW
    md = (tmp_path / "table" / "harness.md").read_text()
    for name, got in out.items():
        row, theirs = rows[name], got["saved"]["results"]
        own = json.loads((got["run"] / "results.json").read_text())
        assert row["harness ppl/word PTB"] == pytest.approx(theirs["mhe_ptb"]["word_perplexity,none"], rel=1e-6)
        assert row["RTE acc"] == theirs["mhe_rte"]["acc,none"]
        assert row["mhe ppl/token WT2"] == own["perplexity"] and row["harness ppl/word WT2"] is None
        assert row["mhe ppl/word WT2"] == own.get("word_perplexity")  # none for the word-level PTB run
        written = json.loads((tmp_path / "cmp" / "runs" / f"{name}-seed0" / "harness-results.json").read_text())
        assert written["results"]["mhe_ptb"]["word_perplexity,none"] == row["harness ppl/word PTB"]
        line, = [line for line in md.splitlines() if line.startswith(f"| {name} | {own['perplexity']:.4g} | ")]
        assert f" | {row['harness ppl/word PTB']:.4g} | " in line and f" | {row['RTE acc']:.4g} | - | - | - |" in line
