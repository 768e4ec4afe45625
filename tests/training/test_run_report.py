"""A run's wall clock by phase (mhe.training.run_report), the tokenizer cache and the compile cache
settings (issue 42): time is split exclusively, the warm-up steps' excess is compilation, and a
tokenizer trained from the same lines and settings is reused, not trained again."""

import json
import os

import pytest
import torch

from mhe.data import tokenize
from mhe.runtime import cache_root, configure_compile_cache
from mhe.training import run_report
from mhe.training.loop import Trainer
from mhe.training.run_report import PHASES, RunClock, vocabulary_note

from test_training import tiny_run
from mhe.tasks.recall import RecallTask


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(run_report.time, "monotonic", fake)
    monkeypatch.setattr(run_report, "process_age", lambda: 4.0)
    monkeypatch.setattr(run_report, "_FIRST_RUN", [True])
    return fake


def test_phases_are_exclusive_and_the_warm_up_excess_is_compilation(clock):
    c = RunClock(warm_steps=2)  # the process started 4 s ago: start-up
    with c.running():
        with c.phase("data"):
            clock.now += 1.0
            with run_report.phase("tokenizer"):  # a task's phase, timed into the running clock
                clock.now += 3.0
            clock.now += 0.5
        with c.phase("steps"):
            for took in (20.0, 2.0, 1.0, 1.0, 1.0):  # compile in the first, capture in the second
                with c.step(run_report.torch.device("cpu")):
                    clock.now += took
            with c.phase("evaluations"):
                clock.now += 2.5
        clock.now += 0.25  # in no phase
    r = c.report()
    assert r["startup_s"] == 4.0 and r["tokenizer_s"] == 3.0 and r["data_s"] == 1.5 and r["evaluations_s"] == 2.5
    assert r["compile_s"] == 20.0  # the two warm-up steps (22 s) less two steady steps of 1 s
    assert r["steps_s"] == 5.0
    assert r["time_to_first_step_s"] == 4.0 + 4.5 + 20.0
    assert r["total_s"] == 4.0 + 4.5 + 25.0 + 2.5 + 0.25 and r["other_s"] == 0.25
    assert r["total_s"] == pytest.approx(sum(r[f"{k}_s"] for k in PHASES) + r["other_s"])
    line = RunClock.line(r)
    assert line.startswith("wall clock 36.2 s: start-up 4.0, tokenizer 3.0, data 1.5") and "compilation and graph " \
        "capture 20.0, steps 5.0" in line and line.endswith("first step done 28.5 s after the process started")


def test_a_second_run_in_the_same_process_counts_from_its_own_start(clock):
    RunClock()
    clock.now += 10
    assert RunClock().report()["startup_s"] == 0.0


def test_a_run_of_warm_up_steps_only_is_all_compilation(clock):
    c = RunClock(warm_steps=3)
    with c.phase("steps"):
        for _ in range(2):
            with c.step(run_report.torch.device("cpu")):
                clock.now += 5.0
    r = c.report()
    assert r["compile_s"] == 10.0 and r["steps_s"] == 0.0


def test_the_vocabulary_note_says_where_the_preset_and_the_tokenizer_differ():
    assert vocabulary_note(49_152, 50_257, "llama-135m") == (
        "vocabulary: 50,257 entries (the run's tokenizer's), not the 49,152 of preset llama-135m: the embedding "
        "and output layers have the tokenizer's size")
    assert vocabulary_note(50_257, 50_257, "gpt2-base") is None and vocabulary_note(0, 300, "x") is None


def test_a_finished_run_reports_its_wall_clock_in_results_and_on_stderr(tmp_path, capsys):
    cfg = tiny_run(extra=["train.progress=true", "train.eval_every=6"])
    result = Trainer(cfg, RecallTask(), tmp_path, log=lambda *_: None).fit()
    saved = json.loads((tmp_path / "results.json").read_text())
    clock = saved["wall_clock"]
    assert saved == result and set(clock) == {"total_s", "time_to_first_step_s", "other_s"} | {f"{k}_s" for k in PHASES}
    assert all(v >= 0 for v in clock.values())
    assert clock["evaluations_s"] > 0 and clock["steps_s"] > 0 and clock["final_evaluation_s"] > 0
    assert clock["time_to_first_step_s"] <= clock["total_s"]
    assert clock["total_s"] == pytest.approx(sum(clock[f"{k}_s"] for k in PHASES) + clock["other_s"], abs=0.06)
    assert "wall clock " in capsys.readouterr().err
    assert Trainer(cfg, RecallTask(), tmp_path, log=lambda *_: None).fit() == saved  # finished: reported as it was


LINES = [f"the {w} sat on the mat number {i}" for i, w in enumerate(["cat", "dog", "bird", "fish"] * 20)]


def test_a_tokenizer_is_trained_once_per_corpus_and_settings(tmp_path, monkeypatch, capsys):
    trained = []
    real = tokenize.train_tokenizer
    monkeypatch.setattr(tokenize, "train_tokenizer", lambda *a, **k: trained.append(a[0]) or real(*a, **k))
    first = tokenize.cached_tokenizer("bpe", LINES, 300, cache=tmp_path)
    again = tokenize.cached_tokenizer("bpe", LINES, 300, cache=tmp_path, progress=True)
    assert len(trained) == 1 and again.to_str() == first.to_str()
    assert "reusing the bpe tokenizer of at most 300 entries trained before on these 80 lines" in capsys.readouterr().err
    tokenize.cached_tokenizer("bpe", LINES, 280, cache=tmp_path)  # another size
    tokenize.cached_tokenizer("bpe", LINES[:-1], 300, cache=tmp_path)  # another corpus
    tokenize.cached_tokenizer("wordpiece", LINES, 300, cache=tmp_path)  # another kind
    assert len(trained) == 4
    entries = sorted((tmp_path / "tokenizers").iterdir())
    assert len(entries) == 4 and not [p for p in entries if p.name.endswith(".tmp")]
    tokenize.cached_tokenizer("bpe", LINES, 300, cache=None)  # no cache: trained
    assert len(trained) == 5


def test_a_damaged_cache_entry_is_trained_again(tmp_path, monkeypatch):
    tokenize.cached_tokenizer("bpe", LINES, 300, cache=tmp_path)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    entry.write_text("{not json")
    trained = []
    real = tokenize.train_tokenizer
    monkeypatch.setattr(tokenize, "train_tokenizer", lambda *a, **k: trained.append(1) or real(*a, **k))
    tok = tokenize.cached_tokenizer("bpe", LINES, 300, cache=tmp_path)
    assert trained == [1] and json.loads(entry.read_text()) == json.loads(tok.to_str())


def test_the_cache_folder_setting(monkeypatch, tmp_path):
    monkeypatch.setenv("MHE_CACHE_DIR", "off")
    assert cache_root() is None
    monkeypatch.setenv("MHE_CACHE_DIR", str(tmp_path))
    assert cache_root() == tmp_path
    monkeypatch.delenv("MHE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mhe"


def test_compile_caches_are_on_and_kept_in_the_cache_folder_unless_the_user_chose(monkeypatch, tmp_path):
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    monkeypatch.setenv("MHE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_FX_GRAPH_CACHE", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_AUTOGRAD_CACHE", raising=False)
    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    assert configure_compile_cache() == str(tmp_path / "inductor")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert configure_compile_cache() == str(tmp_path / "mine")


class CountingTokenizer:
    """A trained tokenizer that counts its encode calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, 0

    def encode_batch(self, *a, **k):
        self.calls += 1
        return self.tok.encode_batch(*a, **k)

    def __getattr__(self, name):
        return getattr(self.tok, name)


def test_a_training_split_is_tokenized_once_per_tokenizer_and_corpus(tmp_path, monkeypatch):
    from mhe.tasks import text

    monkeypatch.setenv("MHE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(text, "CACHED_FROM_LINES", 50)
    tok = CountingTokenizer(tokenize.train_tokenizer("bpe", LINES, 300))
    first = text.token_stream(tok, LINES)
    again = text.token_stream(tok, LINES)
    assert tok.calls == 1 and torch.equal(first, again) and again.dtype == torch.long
    (entry,) = (tmp_path / "tokens").iterdir()
    assert entry.stat().st_size == 4 * first.numel()
    text.token_stream(tok, LINES[:-1])  # another corpus: tokenized
    text.token_stream(CountingTokenizer(tokenize.train_tokenizer("bpe", LINES, 280)), LINES)  # another tokenizer
    assert len(list((tmp_path / "tokens").iterdir())) == 3
    text.token_stream(tok, LINES[:40])  # a short split (valid, test): never cached
    assert tok.calls == 3 and len(list((tmp_path / "tokens").iterdir())) == 3
