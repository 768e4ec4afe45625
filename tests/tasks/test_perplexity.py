"""Sliding-window perplexity against a hand-computed case."""

import math

import pytest
import torch

from mhe.errors import MheError
from mhe.metrics.perplexity import perplexity, sliding_window_nll, window_plan
from mhe.models import ModelOutput


class ContextCounter(torch.nn.Module):
    """P(next token = target) depends only on how much context the window gives it:
    at position j of a window the model puts probability p_j on the true next token
    of the fixed stream (and spreads the rest uniformly)."""

    def __init__(self, stream, vocab):
        super().__init__()
        self.stream, self.vocab = stream, vocab
        self.w = torch.nn.Parameter(torch.zeros(1))

    @staticmethod
    def p(j):
        return 0.5 + 0.4 * (1 - 1 / (j + 1))

    def forward(self, x):
        b, t = x.shape
        logits = torch.full((b, t, self.vocab), 0.0)
        for row in range(b):
            start = next(s for s in range(len(self.stream)) if torch.equal(self.stream[s:s + t], x[row]))
            for j in range(t - 1):
                target = int(self.stream[start + j + 1])
                p = self.p(j)
                rest = (1 - p) / (self.vocab - 1)
                logits[row, j] = math.log(rest)
                logits[row, j, target] = math.log(p)
        return ModelOutput(logits)


def test_window_plan_scores_every_token_once():
    for n, L, s in [(20, 8, 4), (21, 8, 8), (9, 8, 3), (5, 8, 4), (100, 16, 5)]:
        plan = window_plan(n, L, s)
        scored = [t for b, e, k in plan for t in range(e - k, e)]
        assert scored == list(range(1, n)), (n, L, s)
        assert all(e - b <= L and 0 < k <= e - b - 1 for b, e, k in plan)  # a predecessor in the window


def test_sliding_window_nll_hand_computed():
    torch.manual_seed(0)
    stream = torch.arange(20) * 7 % 23  # distinct windows so the fake model can locate them
    model = ContextCounter(stream, 23)
    total, count = sliding_window_nll(model, stream, max_len=8, stride=4, batch_size=3)
    # by hand: windows start at 0, 4, 8, 12; window 0 scores tokens 1..7 with context j = t-1;
    # later windows [b, b+8) score their last 4 tokens, token t at in-window position t-b,
    # predicted from position j = t-b-1.
    expect = -sum(math.log(ContextCounter.p(t - 1)) for t in range(1, 8))
    for b in (4, 8, 12):
        expect -= sum(math.log(ContextCounter.p(t - b - 1)) for t in range(b + 4, min(b + 8, 20)))
    assert count == 19
    assert total == pytest.approx(expect, rel=1e-5)
    assert perplexity(total, count) == pytest.approx(math.exp(expect / 19), rel=1e-5)


def test_disjoint_windows_score_every_token_with_context():
    """stride == max_len: each window still scores at most max_len - 1 tokens (regression test:
    scoring a window's first token counted it without its log-probability)."""
    torch.manual_seed(0)
    stream = torch.arange(40) * 7 % 43
    model = ContextCounter(stream, 43)
    total, count = sliding_window_nll(model, stream, max_len=8, stride=8)
    plan = window_plan(40, 8, 8)
    expect = 0.0
    for b, e, k in plan:
        expect -= sum(math.log(ContextCounter.p(t - b - 1)) for t in range(e - k, e))
    assert count == 39 and total == pytest.approx(expect, rel=1e-6)
    assert perplexity(total, count) > 1.2  # p <= 0.9 for every token


def test_uniform_model_has_perplexity_vocab_size():
    class Uniform(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, x):
            return ModelOutput(torch.zeros(*x.shape, 37))

    ids = torch.randint(0, 37, (300,))
    total, n = sliding_window_nll(Uniform(), ids, max_len=64, stride=16)
    assert n == 299 and perplexity(total, n) == pytest.approx(37.0, rel=1e-6)


def test_bad_stride():
    with pytest.raises(MheError, match="stride must be in 1..max_len=8, got 9"):
        window_plan(100, 8, 9)


@pytest.mark.parametrize("cutoffs", [[], [20, 60]])
def test_real_model_fast_path_equals_full_logits(cutoffs):
    """target_log_probs (output layer on scored positions only) equals scoring the full logits,
    for the tied softmax and for the adaptive softmax; the adaptive logits are normalised."""
    from mhe.models import build_model

    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention="mhe-mul", vocab_size=99, d_model=32, n_heads=4, n_layers=2,
                        max_len=16, adaptive_cutoffs=cutoffs).double().eval()
    ids = torch.randint(0, 99, (70,))

    class LogitsOnly(torch.nn.Module):  # the generic path: full logits, log_softmax, gather
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)

    fast = sliding_window_nll(model, ids, max_len=16, stride=8)
    slow = sliding_window_nll(LogitsOnly(model), ids, max_len=16, stride=8)
    assert fast[1] == slow[1] == 69 and fast[0] == pytest.approx(slow[0], rel=1e-10)
    if cutoffs:
        lp = model(ids[None, :16]).logits
        assert torch.allclose(lp.exp().sum(-1), torch.ones(1, 16, dtype=torch.float64))
        loss = model(ids[None, :16], labels=ids[None, :16], return_logits=False).loss
        assert loss.item() == pytest.approx(-model.target_log_probs(ids[None, :16]).mean().item(), rel=1e-10)


def test_lm_final_is_one_pass_unless_a_second_stride_is_asked_for(tmp_path, monkeypatch):
    """max_len 32 caps the paper's stride 256 at 16: the final evaluation is one sliding-window pass
    at 16 (issue 45); ``data.eval_second_stride=32`` adds a second, reported beside it, equal to a
    direct sliding-window computation at stride 32, and leaves the run's hash as it was."""
    import random

    from mhe.metrics.perplexity import perplexity
    from mhe.tasks.lm import CausalLMTask
    from mhe.tasks.text import token_stream
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.distributed import Dist

    rng = random.Random(0)
    words = [f"w{i}" for i in range(50)]
    (tmp_path / "ptb").mkdir()
    for split, n in (("train", 200), ("valid", 20), ("test", 30)):
        lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(n)]
        (tmp_path / "ptb" / f"ptb.{split}.txt").write_text("\n".join(lines) + "\n")
    cfg = apply_overrides(default_run("lm", "tiny-decoder", "mhe-mul", "ptb"),
                          [f"data.data_dir={tmp_path}", "model.max_len=32", "model.d_model=32", "model.d_ff=64",
                           "model.n_layers=1", "data.eval_batch_size=4"])
    task = CausalLMTask()
    model = task.setup(cfg, tmp_path / "run", Dist()).eval()
    import mhe.tasks.lm as lm_module
    passes = []
    real = lm_module.sliding_window_nll
    monkeypatch.setattr(lm_module, "sliding_window_nll", lambda *a, **k: passes.append(k["stride"]) or real(*a, **k))
    one = task.final(model)
    assert passes == [16] and one["stride"] == 16 and not any(k.endswith("stride32") for k in one)
    second = apply_overrides(cfg, ["data.eval_second_stride=32"])
    assert second.hash() == cfg.hash()
    task.cfg = second
    res = task.final(model)
    assert passes == [16, 16, 32] and res["perplexity"] == one["perplexity"]
    assert res["stride"] == 16 and "perplexity_stride32" in res
    test_lines = (tmp_path / "ptb" / "ptb.test.txt").read_text().splitlines()
    nll, n = sliding_window_nll(model, token_stream(task.tok, test_lines), max_len=32, stride=32, batch_size=4)
    assert res["perplexity_stride32"] == pytest.approx(perplexity(nll, n), rel=1e-12)
    assert res["perplexity_stride32"] != res["perplexity"]
