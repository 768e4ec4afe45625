"""Tiny trained runs built once per test session and shared (through conftest) by the tests
that need a finished run directory: ``lm_run`` (PTB, word level) and ``mt_run`` (Multi30k).

Each is made through the ``mhe`` entry point exactly as a user would, with sizes small enough
to train in about a second; checkpoints are kept so that loading can be checked against them.
"""

from __future__ import annotations

import pytest

from conftest import require_data
from mhe.cli import main

COMMON = ["--set", "train.steps=4", "--set", "train.eval_every=2", "--set", "train.save_every=2",
          "--set", "train.keep_checkpoints=true", "--set", "train.progress=false", "--set", "train.log_every=1"]


@pytest.fixture(scope="session")
def lm_run(tmp_path_factory):
    """A 4-step causal LM run on the first 200 lines of PTB (1 layer, width 32, window 32)."""
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    out = tmp_path_factory.mktemp("runs") / "lm"
    assert main(["train", "--task", "lm", "--preset", "tiny-decoder", "--attention", "mhe-mul", "--data", "ptb",
                 "--data-dir", str(root), "--out", str(out), *COMMON,
                 "--set", "data.limit_lines=200", "--set", "train.batch_size=4", "--set", "model.n_layers=1",
                 "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.max_len=32"]) == 0
    return out


@pytest.fixture(scope="session")
def mt_run(tmp_path_factory):
    """A 4-step English-German run on the first 300 Multi30k pairs (shared BPE of 300 tokens)."""
    root = require_data("multi30k/train.en.gz", "multi30k/val.en.gz", "multi30k/test_2016_flickr.de.gz")
    out = tmp_path_factory.mktemp("runs") / "mt"
    assert main(["train-mt", "--preset", "tiny-encoder-decoder", "--attention", "mhe-mul",
                 "--data-dir", str(root), "--out", str(out), *COMMON,
                 "--set", "data.limit_lines=300", "--set", "data.vocab_size=300", "--set", "model.max_len=24",
                 "--set", 'data.task_options={"test_sentences": 10, "eval_sentences": 10, "beam": 2}']) == 0
    return out
