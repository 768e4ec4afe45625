"""Settings that shape a result, tested by their effect (issue 66; the table in tests/README.md
names every such setting and its test): BERT's masking proportions and masked LM's evaluation
masks, beam search's length penalty (and translation's ``alpha`` reaching it), the strides of
the final perplexity, ``--min-new-tokens``, and label smoothing refused where no loss reads it.

Proportions are checked against exact binomial intervals at confidence ``1 - 1e-6`` (each
check; the draws are from a fixed generator, so the outcome is the same every run). At a
million tokens an interval is about +-0.4 percentage points wide, so moving any of the 15%,
80% or 10% constants by one point fails.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import binom

from mhe.generation.beam import beam_search, best_hypotheses, length_penalty
from mhe.tasks.mlm import MaskedLMTask, mask_tokens
from reference import beam_search_uncached, best_by_length_penalty, gnmt_length_penalty

CONFIDENCE = 1 - 1e-6
PAD, CLS, SEP, MASK = 0, 1, 2, 3
SPECIAL = torch.tensor([PAD, CLS, SEP, MASK])


def in_interval(count: int, n: int, p: float) -> bool:
    """Whether ``count`` lies in the central binomial(n, p) interval at :data:`CONFIDENCE`."""
    lo, hi = binom.interval(CONFIDENCE, n, p)
    return lo <= count <= hi


def corpus(rows=1024, cols=1024, vocab=24, seed=0) -> torch.Tensor:
    """Packed blocks as MaskedLMTask makes them ([CLS] ... [SEP]) with some padding and some
    literal [MASK] tokens in the text: ids 4..vocab-1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (rows, cols), generator=g)
    ids[:, 0], ids[:, -1] = CLS, SEP
    ids[::7, -40:] = PAD
    ids[::5, 10:20] = MASK
    return ids


def proportions_hold(ids, inputs, labels, *, vocab, prob) -> dict[str, bool]:
    """Each count of BERT's corruption against its binomial interval. A chosen token becomes
    [MASK] with probability 0.8, a uniform token of ``[0, vocab)`` with 0.1 and stays with 0.1;
    the uniform draw can itself be [MASK] or the original token (probability 1/vocab each), so
    the observed [MASK] share is 0.8 + 0.1/vocab, the unchanged share 0.1 + 0.1/vocab and the
    share of other tokens 0.1 (1 - 2/vocab)."""
    eligible = ~torch.isin(ids, SPECIAL)
    chosen = labels != -100
    k = int(chosen.sum())
    got = inputs[chosen]
    orig = ids[chosen]
    return {
        "chosen": in_interval(k, int(eligible.sum()), prob),
        "mask": in_interval(int((got == MASK).sum()), k, 0.8 + 0.1 / vocab),
        "kept": in_interval(int((got == orig).sum()), k, 0.1 + 0.1 / vocab),
        "random": in_interval(int(((got != MASK) & (got != orig)).sum()), k, 0.1 * (1 - 2 / vocab)),
    }


# ---------------------------------------------------------------- BERT's masking
def test_mask_tokens_labels_and_untouched_positions():
    vocab = 24
    ids = corpus(256, 128, vocab)
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=vocab, special=SPECIAL,
                                 generator=torch.Generator().manual_seed(1))
    chosen = labels != -100
    assert chosen.any() and not (chosen & torch.isin(ids, SPECIAL)).any()  # never a special token
    assert torch.equal(labels[chosen], ids[chosen])  # the original ids where chosen, -100 elsewhere
    assert (labels[~chosen] == -100).all()
    assert torch.equal(inputs[~chosen], ids[~chosen])  # nothing else is touched
    random = chosen & (inputs != MASK) & (inputs != ids)
    assert random.any() and int(inputs[random].min()) >= 0 and int(inputs[random].max()) < vocab
    again = mask_tokens(ids, mask_id=MASK, vocab_size=vocab, special=SPECIAL,
                        generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], inputs) and torch.equal(again[1], labels)  # the generator decides


@pytest.mark.parametrize("vocab", [24, 30000])
def test_mask_tokens_proportions_are_berts(vocab):
    """15% of the non-special tokens chosen; of those 80% [MASK], 10% random, 10% unchanged
    (a small vocabulary makes the random draw's coincidences count: 0.4% of the chosen)."""
    ids = corpus(vocab=vocab)
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=vocab, special=SPECIAL,
                                 generator=torch.Generator().manual_seed(2))
    assert proportions_hold(ids, inputs, labels, vocab=vocab, prob=0.15) == dict.fromkeys(
        ("chosen", "mask", "kept", "random"), True)
    random = (labels != -100) & (inputs != MASK) & (inputs != ids)
    if vocab == 24:  # the random token comes from the whole vocabulary (special ids included)
        counts = torch.bincount(inputs[random], minlength=vocab)
        assert counts.numel() == vocab and bool((counts[torch.arange(vocab) != MASK] > 0).all())


def test_the_coincidences_of_the_random_token_are_counted():
    """The intervals are tight enough to see the random draw's coincidences: at a 24-token
    vocabulary and four million tokens the unchanged share expected without them (exactly 0.1)
    is rejected for the same draws, the share with them is not."""
    vocab = 24
    ids = corpus(4096, 1024, vocab)
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=vocab, special=SPECIAL,
                                 generator=torch.Generator().manual_seed(2))
    chosen = labels != -100
    k = int(chosen.sum())
    kept = int((inputs[chosen] == ids[chosen]).sum())
    assert in_interval(kept, k, 0.1 + 0.1 / vocab) and not in_interval(kept, k, 0.1)


@pytest.mark.parametrize("prob", [0.05, 0.4])
def test_mask_tokens_honours_prob(prob):
    vocab = 24
    ids = corpus(vocab=vocab)
    inputs, labels = mask_tokens(ids, mask_id=MASK, vocab_size=vocab, special=SPECIAL, prob=prob,
                                 generator=torch.Generator().manual_seed(3))
    held = proportions_hold(ids, inputs, labels, vocab=vocab, prob=prob)
    assert held == dict.fromkeys(("chosen", "mask", "kept", "random"), True)
    eligible = int((~torch.isin(ids, SPECIAL)).sum())
    assert not in_interval(int((labels != -100).sum()), eligible, 0.15)  # not the default's share


def test_masked_lm_batches_are_berts_corruption():
    """The task's training batches: the default 15% and 80/10/10 (global generator), labels as
    the model reads them, and the positions the head scores are the labelled ones."""
    vocab = 24
    task = MaskedLMTask()
    task.blocks, task.mask_id, task.vocab, task.special = corpus(vocab=vocab), MASK, vocab, SPECIAL
    torch.manual_seed(4)
    batch = task.collate(torch.arange(1024))
    inputs, labels = batch["input_ids"], batch["labels"]
    assert proportions_hold(task.blocks, inputs, labels, vocab=vocab, prob=0.15) == dict.fromkeys(
        ("chosen", "mask", "kept", "random"), True)
    assert torch.equal(batch["masked_positions"], (labels.flatten() != -100).nonzero().squeeze(1))
    assert batch["n_tokens"] == int((labels != -100).sum())


# ---------------------------------------------------------------- beam search's length penalty
def test_length_penalty_is_gnmts():
    """Within one float32 ulp: the search's pow runs vectorised over the lengths and the reference's
    on one scalar at a time, and on some CPUs the two differ in the last bit."""
    lengths = torch.arange(1, 30)
    for alpha in (0.0, 0.6, 1.0, 2.5):
        want = torch.stack([gnmt_length_penalty(int(n), alpha) for n in lengths])
        torch.testing.assert_close(length_penalty(lengths, alpha), want, rtol=torch.finfo(torch.float32).eps, atol=0)


def test_length_penalty_decides_between_a_short_and_a_long_hypothesis():
    """Two finished hypotheses of one source: A ends after 2 tokens with log-probability -2.0,
    B after 10 with -3.0. Unpenalised (alpha 0) A wins; lp(2) = (7/6)^alpha and lp(10) =
    (15/6)^alpha, so B wins once 3 / 2.5^alpha < 2 / (7/6)^alpha, i.e. alpha > 0.53."""
    eos = 2
    a = [1, 5, eos] + [eos] * 8
    b = [1] + [6] * 9 + [eos]
    tokens, scores = torch.tensor([a, b]), torch.tensor([[-2.0, -3.0]])
    winners = {}
    for alpha in (0.0, 0.5, 0.6, 1.0, 3.0):
        out, score = best_hypotheses(tokens, scores, eos_id=eos, alpha=alpha)
        ref, ref_score = best_by_length_penalty(tokens, scores, eos_id=eos, alpha=alpha)
        assert torch.equal(out, ref) and torch.equal(score, ref_score)
        winners[alpha] = "A" if out.shape[1] == 3 else "B"
    assert winners == {0.0: "A", 0.5: "A", 0.6: "B", 1.0: "B", 3.0: "B"}


def test_length_penalty_changes_which_translation_a_search_returns():
    """A model whose hypotheses end after 0 to about 15 tokens (``ending_model``): for each
    alpha the search returns what the literal uncached search returns (its own length penalty,
    :func:`reference.best_by_length_penalty`); the beams do not depend on alpha, so a larger alpha
    never picks a shorter hypothesis, and across these values it picks longer ones for some
    sources."""
    from test_beam_batching import EOS, ending_model, sources

    model = ending_model()
    src, mask = sources()
    lengths = {}
    for alpha in (0.0, 0.6, 1.0, 2.0, 5.0):
        got, got_scores = beam_search(model, src, mask, bos_id=1, eos_id=EOS, beam=4, max_len=40, alpha=alpha,
                                      return_scores=True)
        want, want_scores = beam_search_uncached(model, src, mask, bos_id=1, eos_id=EOS, beam=4, max_len=40,
                                                 alpha=alpha, return_scores=True)
        assert torch.equal(got, want), alpha
        torch.testing.assert_close(got_scores, want_scores, rtol=1e-12, atol=1e-12)
        lengths[alpha] = ((got[:, 1:] != EOS).cumprod(1)).sum(1)
    steps = list(lengths.values())
    assert all(bool((later >= earlier).all()) for earlier, later in zip(steps, steps[1:]))
    changed = [int((later > earlier).sum()) for earlier, later in zip(steps, steps[1:])]
    assert sum(1 for c in changed if c) >= 2, changed  # the winner moves at more than one step of alpha


# ---------------------------------------------------------------- the final perplexity's strides
def test_final_perplexity_uses_both_strides(lm_run):
    """``data.eval_stride`` sets the final figure's stride (capped at half the window) and
    ``data.eval_second_stride`` adds ``perplexity_strideN``: each equals the direct sliding
    window at its stride, and the two differ."""
    import math

    from conftest import require_data
    from mhe.tasks.runs import load_run
    from mhe.tasks.text import token_stream
    from test_cli_runs import direct_sliding_window_nll

    root = require_data("ptb/ptb.test.txt.gz")
    model, cfg, task = load_run(lm_run, data_dir=str(root))
    task.test_lines = task.test_lines[:12]
    task.cfg.data.eval_stride, task.cfg.data.eval_second_stride = 6, 24
    res = task.final(model)
    ids = token_stream(task.tok, task.test_lines)
    nll, n = direct_sliding_window_nll(model, ids, window=model.cfg.max_len, stride=6)
    assert res["stride"] == 6 and res["tokens"] == n
    assert res["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-6)
    nll24, _ = direct_sliding_window_nll(model, ids, window=model.cfg.max_len, stride=24)
    assert res["perplexity_stride24"] == pytest.approx(math.exp(nll24 / n), rel=1e-6)
    assert res["perplexity_stride24"] != pytest.approx(res["perplexity"], rel=1e-6)
    task.cfg.data.eval_stride = 100  # capped at half the 32-token window
    assert task.final(model)["stride"] == 16
    task.valid = task.valid[:400]  # validation: windows of the whole width, one token shared
    nll, n = direct_sliding_window_nll(model, task.valid, window=model.cfg.max_len, stride=model.cfg.max_len)
    res = task.evaluate(model)
    assert res["tokens"] == n and res["nll"] == pytest.approx(nll, rel=1e-6)


def test_masked_lm_evaluation_masks_the_same_tokens_every_time():
    """Validation accuracy and loss of masked LM: the masks of a generator seeded 12345 (the same
    at every evaluation, so figures of one run compare), scored on the masked positions of the
    model's full logits, written out here."""
    import torch.nn.functional as F

    from mhe.models import build_model

    vocab = 50
    task = MaskedLMTask()
    task.valid, task.mask_id, task.vocab, task.special = corpus(70, 32, vocab), MASK, vocab, SPECIAL
    model = build_model("tiny-encoder", vocab_size=vocab, d_model=32, n_heads=4, d_ff=64, n_layers=1, max_len=32,
                        dropout=0.0, attn_dropout=0.0).double().eval()
    got = task.evaluate(model)
    assert task.evaluate(model) == got
    g = torch.Generator().manual_seed(12345)
    correct, nll, total = 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, 70, 32):
            inputs, labels = mask_tokens(task.valid[i:i + 32], mask_id=MASK, vocab_size=vocab, special=SPECIAL,
                                         generator=g)
            logp = F.log_softmax(model(inputs).logits, -1)
            sel = labels != -100
            correct += int((logp[sel].argmax(-1) == labels[sel]).sum())
            nll -= float(logp[sel].gather(1, labels[sel][:, None]).sum())
            total += int(sel.sum())
    assert got["mlm_accuracy"] == correct / total
    assert got["mlm_loss"] == pytest.approx(nll / total, rel=1e-6)  # the loss is taken in float32


def test_translation_task_decodes_with_its_alpha():
    """The task's ``alpha`` option reaches the search, by its effect: a random model whose
    hypotheses end at different lengths (EOS favoured, as in ``ending_model``) translates as
    the literal search does with that alpha, and the translations change with alpha."""
    import dataclasses

    from mhe.tasks.translation import pad_rows
    from test_task_settings import _tiny_translation

    model, task, texts = _tiny_translation(beam=4)
    task.max_len = 24
    with torch.no_grad():
        model.lm_head.weight[task.eos, 0] = 4.0  # (tied: the EOS embedding too)
    lines = ["a man rides a bike .", "two dogs play in the snow .", "a girl reads a book .", "a dog .",
             "two men read .", "a girl rides a dog in the snow ."]
    outs = {}
    for alpha in (0.0, 1.0, 4.0):
        task.o = dataclasses.asdict(dataclasses.replace(task.cfg.data.task_options, alpha=alpha))
        outs[alpha] = task.translate(model, lines)
        for line, got in zip(lines, outs[alpha]):
            src = pad_rows([task._encode(line)], task.pad)
            hyp = beam_search_uncached(model, src, src != task.pad, bos_id=task.bos, eos_id=task.eos, beam=4,
                                       max_len=task.max_len, alpha=alpha)[0].tolist()[1:]
            hyp = hyp[:hyp.index(task.eos)] if task.eos in hyp else hyp
            assert got == task.tok.decode(hyp, skip_special_tokens=True).strip(), (alpha, line)
    assert outs[0.0] != outs[1.0] != outs[4.0], outs


# ---------------------------------------------------------------- mhe generate's --min-new-tokens
def test_generate_min_new_tokens_holds_the_end_token_back(lm_run, capsys, monkeypatch):
    """The run's model with the end token made the likeliest at every step (its logit raised
    by 50 through a constant unit of the final norm): without ``--min-new-tokens`` each prompt
    stops after one token, with 3 the end token is held back for three and ends the fourth."""
    import mhe.tasks.runs as runs
    from mhe.cli import main
    from mhe.data.tokenize import special_id

    real = runs.load_run

    def ending(*args, **kw):
        model, cfg, task = real(*args, **kw)
        eos = special_id(task.tok, "[EOS]")
        with torch.no_grad():
            norm = model.decoder.final_norm
            norm.weight[0], norm.bias[0] = 0.0, 1.0
            model.lm_head.weight[eos, 0] = 50.0
        return model, cfg, task

    monkeypatch.setattr(runs, "load_run", ending)
    stopped = {}
    for least in (0, 3):
        capsys.readouterr()
        assert main(["generate", "--run", str(lm_run), "--prompt", "the company said", "--prompt", "it",
                     "--max-new-tokens", "6", "--min-new-tokens", str(least)]) == 0
        stopped[least] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("prompt ")]
    assert stopped == {n: [f"prompt {i}: {n + 1} new token{'s' if n else ''}, stopped by the end token"
                           for i in (1, 2)] for n in (0, 3)}


# ---------------------------------------------------------------- label smoothing where no loss reads it
@pytest.mark.parametrize("task", ["recall", "lm"])
def test_label_smoothing_is_refused_where_the_loss_ignores_it(task, tmp_path, capsys):
    """Only translation's loss reads ``train.label_smoothing``; another task would train without
    it, so a non-zero value is refused in one line before any folder is made."""
    from mhe.cli import main

    out = tmp_path / "run"
    data = ["--data", "ptb", "--data-dir", str(tmp_path)] if task == "lm" else []
    capsys.readouterr()
    assert main(["train", "--task", task, "--preset", "tiny-decoder", *data, "--out", str(out),
                 "--set", "train.label_smoothing=0.1"]) == 2
    err = capsys.readouterr().err
    assert f"train.label_smoothing=0.1 has no effect on the {task} task" in err and "Traceback" not in err
    assert not out.exists()
