"""``mhe eval``, ``mhe translate`` and ``load_run`` on tiny trained runs (tests/tiny_runs.py),
each checked against a direct computation from the saved files: the weights in the run's
safetensors, its tokenizer, the model's own beam search, a per-window NLL written plainly."""

import io
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from mhe.tasks import run_config_from_dict
from mhe.tasks.runs import load_run
from mhe.cli import main
from mhe.data.tokenize import load_tokenizer
from mhe.errors import MheError
from mhe.models import build_model
from reference import beam_search_uncached
from mhe.tasks.text import corpus_lines, token_stream
from mhe.training.config import RunConfig


def saved_model(run, weights):
    """The run's model rebuilt from config.json and the given safetensors file, without load_run."""
    cfg = run_config_from_dict(json.loads((run / "config.json").read_text())["run"], source="test")
    tok = load_tokenizer(run)
    extra = {"pad_id": tok.token_to_id("[PAD]")} if cfg.task == "mt" else {}
    model = build_model(cfg.model, vocab_size=tok.get_vocab_size(), **extra)
    model.load_state_dict(load_file(str(weights)))
    return model.eval(), cfg, tok


def assert_same_weights(model, path):
    saved = load_file(str(path))
    state = model.state_dict()
    assert saved.keys() <= state.keys()
    for name, tensor in saved.items():
        assert torch.equal(state[name], tensor), name


def test_load_run_returns_the_saved_weights(lm_run):
    step2 = lm_run / "checkpoints" / "step-00000002"
    best = lm_run / "best" / "model.safetensors"
    assert best.is_file() and (step2 / "model.safetensors").is_file()
    model, cfg, task = load_run(lm_run)  # a run directory: its best evaluated weights
    assert cfg.task == "lm" and not model.training
    assert_same_weights(model, best)
    model2, _, _ = load_run(step2)  # a checkpoint folder: exactly that checkpoint
    assert_same_weights(model2, step2 / "model.safetensors")
    fresh = build_model(cfg.model, vocab_size=task.tok.get_vocab_size())
    assert not all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model2.state_dict().values()))


def test_load_run_refuses_a_folder_that_is_not_a_run(tmp_path):
    with pytest.raises(MheError, match="is not a run folder: pass the folder that holds config.json"):
        load_run(tmp_path)
    with pytest.raises(MheError, match="none does not exist"):
        load_run(tmp_path / "none")


def direct_sliding_window_nll(model, ids, *, window, stride):
    """One window at a time, one token at a time, in float64: every token after the first is
    scored once, by the first window that holds it and the token before it; windows start
    every ``stride`` tokens (never after the last scored token)."""
    nll, scored, begin, done = 0.0, 0, 0, 1
    while done < len(ids):
        end = min(begin + window, len(ids))
        x = ids[begin:end]
        logp = F.log_softmax(model(x[None]).logits[0].double(), -1)  # [L, V]
        for t in range(done, end):
            nll -= logp[t - begin - 1, ids[t]].item()
            scored += 1
        done, begin = end, min(begin + stride, end - 1)
    return nll, scored


def test_eval_follows_the_runs_evaluation_precision(lm_run, capsys, tmp_path, monkeypatch):
    """``mhe eval`` of a run with ``data.eval_precision=train`` computes under the training autocast
    (bf16 here, forced on the CPU), as the trainer's evaluations do: the figure moves by bf16
    rounding only; with the default (float32) the same forced autocast changes nothing."""
    import mhe.training.step as step

    monkeypatch.setattr(step, "precision", lambda setting, device: torch.bfloat16)
    run = tmp_path / "run"
    shutil.copytree(lm_run, run)

    def nll(setting):
        record = json.loads((run / "config.json").read_text())
        record["run"]["data"]["eval_precision"] = setting
        (run / "config.json").write_text(json.dumps(record))
        capsys.readouterr()
        assert main(["eval", "--task", "lm", "--run", str(run), "--split", "valid", "--stride", "12"]) == 0
        return json.loads(capsys.readouterr().out)["nll"]
    float32, bf16 = nll("float32"), nll("train")
    model, cfg, tok = saved_model(lm_run, lm_run / "best" / "model.safetensors")
    want, _ = direct_sliding_window_nll(model, token_stream(tok, corpus_lines(cfg, "valid")),
                                        window=model.cfg.max_len, stride=12)
    assert float32 == pytest.approx(want, rel=1e-6)
    assert bf16 != pytest.approx(want, rel=1e-6) and bf16 == pytest.approx(want, rel=2e-2)
    # --precision overrides the run's setting either way (the run now says "train")
    for flag, expected in (("float32", float32), ("train", bf16)):
        capsys.readouterr()
        assert main(["eval", "--task", "lm", "--run", str(run), "--split", "valid", "--stride", "12",
                     "--precision", flag]) == 0
        assert json.loads(capsys.readouterr().out)["nll"] == expected


def test_eval_refuses_an_unknown_precision(lm_run, capsys):
    assert main(["eval", "--task", "lm", "--run", str(lm_run), "--precision", "fp16"]) == 2
    err = capsys.readouterr().err
    assert "--precision" in err and "'fp16'" in err and "float32" in err and "Traceback" not in err


@torch.no_grad()
def test_eval_perplexity_equals_a_direct_sliding_window_computation(lm_run, capsys, tmp_path):
    out = tmp_path / "eval.json"
    capsys.readouterr()
    assert main(["eval", "--task", "lm", "--checkpoint", str(lm_run), "--split", "valid", "--stride", "12",
                 "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    res = json.loads(out.read_text())
    assert printed == res and res["split"] == "valid" and res["stride"] == 12
    model, cfg, tok = saved_model(lm_run, lm_run / "best" / "model.safetensors")
    ids = token_stream(tok, corpus_lines(cfg, "valid"))
    nll, n = direct_sliding_window_nll(model, ids, window=model.cfg.max_len, stride=12)
    assert res["tokens"] == n == len(ids) - 1
    assert res["nll"] == pytest.approx(nll, rel=1e-6)
    assert res["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-6)


def test_eval_refuses_a_run_of_another_task(lm_run, capsys):
    assert main(["eval", "--task", "recall", "--checkpoint", str(lm_run)]) == 2
    assert "is a 'lm' run; --task says 'recall'" in capsys.readouterr().err


def test_eval_reads_only_the_runs_tokenizer_and_the_split_scored(lm_run, tmp_path, capsys):
    """With a data folder that holds the test split alone, the figures equal those made where the
    whole corpus is: neither the training text nor the validation split is read (or tokenised)."""
    from conftest import require_data

    root = require_data("ptb/ptb.test.txt.gz")
    (tmp_path / "ptb").mkdir()
    shutil.copyfile(root / "ptb" / "ptb.test.txt.gz", tmp_path / "ptb" / "ptb.test.txt.gz")
    capsys.readouterr()
    assert main(["eval", "--run", str(lm_run), "--split", "test", "--data-dir", str(tmp_path)]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert main(["eval", "--run", str(lm_run), "--split", "test", "--data-dir", str(root)]) == 0
    assert json.loads(capsys.readouterr().out) == alone


@pytest.mark.parametrize("command", [["generate", "--prompt", "a dog"], ["eval"]])
def test_the_runs_type_is_checked_before_anything_is_set_up(command, mt_run, monkeypatch, capsys):
    """generate (or eval of an lm) on a translation run: refused before the task reads a file."""
    from mhe.tasks.translation import TranslationTask

    def refuse(*_):
        raise AssertionError("set up before the run's type was checked")

    monkeypatch.setattr(TranslationTask, "setup", refuse)
    monkeypatch.setattr(TranslationTask, "setup_inference", refuse)
    assert main([command[0], "--run", str(mt_run), *command[1:]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a 'mt' run" in err


def sharp_checkpoint(run, dest):
    """A copy of ``run`` with one more checkpoint, written by the project's own writer, whose
    weights are drawn large: a 4-step model still emits the same tokens for every input, and
    only a model whose output depends on its input can show translations swapped or mis-decoded."""
    import shutil

    from mhe.training.checkpoint import save_checkpoint
    from mhe.training.state import rng_state

    shutil.copytree(run, dest)
    model, _, _ = load_run(run)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # layer norms keep their trained affine
                p.normal_(0, 0.2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    state = {"step": 99, "optimizer": opt.state_dict(), "scheduler": {}, "rng": rng_state(), "data": {}}
    return save_checkpoint(dest / "checkpoints", model=model, state=state, keep_last=0)


@torch.no_grad()
def test_translate_equals_the_models_own_beam_search(mt_run, capsys, tmp_path):
    point = sharp_checkpoint(mt_run, tmp_path / "run")
    # sources of different lengths, so the batch that ``translate`` decodes is padded
    sources = ["A dog.", "Two men are playing football in a park.", "", "A girl in a red coat.", "Men",
               "A woman sits on a bench and reads a book."]  # a blank line gives a blank translation
    (tmp_path / "src.en").write_text("\n".join(sources) + "\n")
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(point), "--input", str(tmp_path / "src.en"),
                 "--beam", "3", "--alpha", "0.6"]) == 0
    got = capsys.readouterr().out.split("\n")[:-1]
    model, _, tok = saved_model(mt_run, point / "model.safetensors")
    bos, eos = tok.token_to_id("[BOS]"), tok.token_to_id("[EOS]")
    want = []
    for s in sources:  # one sentence at a time: no batching, no padding, no cache
        if not s.strip():
            want.append("")
            continue
        src = torch.tensor([tok.encode(s, add_special_tokens=False).ids[: model.cfg.max_len - 2]])
        hyp = beam_search_uncached(model, src, bos_id=bos, eos_id=eos, beam=3, max_len=model.cfg.max_len,
                                   alpha=0.6)[0, 1:].tolist()
        hyp = hyp[: hyp.index(eos)] if eos in hyp else hyp
        want.append(tok.decode(hyp, skip_special_tokens=True).strip())
    assert len(set(want) - {""}) >= 4  # the output depends on the input: order and padding matter
    assert got == want


def test_translate_refuses_a_run_of_another_task(lm_run, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"A dog.\n")))
    assert main(["translate", "--checkpoint", str(lm_run), "--input", "-"]) == 2
    assert "is a 'lm' run; mhe translate needs a translation (mt) run" in capsys.readouterr().err


def test_translate_needs_only_the_run_folder(tmp_path, monkeypatch, capsys):
    """A translation run copied elsewhere translates with the data folder empty: the run holds its
    tokenizer and no corpus is read; the translations equal those made where the data is."""
    import shutil

    from conftest import require_data
    from tiny_runs import COMMON

    root = require_data("multi30k/train.en.gz", "multi30k/val.en.gz", "multi30k/test_2016_flickr.de.gz")
    monkeypatch.setenv("MHE_DATA", str(root))  # no --data-dir: the run records no data folder
    monkeypatch.chdir(tmp_path)  # no --out: the default folder names data, languages, preset and kind
    run = tmp_path / "runs" / "mt-multi30k-en-de-tiny-encoder-decoder-mha"
    assert main(["train-mt", "--preset", "tiny-encoder-decoder", *COMMON,
                 "--set", "data.limit_lines=100", "--set", "data.vocab_size=200", "--set", "model.max_len=16",
                 "--set", 'data.task_options={"test_sentences": 4, "eval_sentences": 4}']) == 0
    (tmp_path / "src.en").write_text("A dog runs.\nTwo men are playing football in a park.\n")
    capsys.readouterr()
    assert main(["translate", "--checkpoint", str(run), "--input", str(tmp_path / "src.en")]) == 0
    with_data = capsys.readouterr().out
    moved = tmp_path / "elsewhere" / "mt"
    shutil.copytree(run, moved)
    empty = tmp_path / "no-data"
    empty.mkdir()
    monkeypatch.setenv("MHE_DATA", str(empty))
    assert main(["translate", "--checkpoint", str(moved), "--input", str(tmp_path / "src.en")]) == 0
    captured = capsys.readouterr()
    assert captured.out == with_data and len(with_data.splitlines()) == 2
    assert "not found" not in captured.err


def test_a_cuda_device_without_an_index_is_made_current_as_the_current_card(monkeypatch):
    """``--device auto`` and ``cuda`` name no card: ``load_run`` places the model on the current
    card and makes that card current with its index (``torch.cuda.set_device`` refuses a bare
    ``cuda``; a GPU run of ``mhe eval`` failed on it); ``cuda:N`` makes card N current; the CPU
    touches no CUDA state."""
    import torch

    from mhe.tasks.runs import made_current

    made = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: made.append(d))
    assert made_current(torch.device("cuda")) == torch.device("cuda", 3) and made == [torch.device("cuda", 3)]
    assert made_current(torch.device("cuda:1")) == torch.device("cuda", 1) and made[-1] == torch.device("cuda", 1)
    assert made_current(torch.device("cpu")) == torch.device("cpu") and len(made) == 2
