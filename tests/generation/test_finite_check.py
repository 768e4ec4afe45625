"""The per-step finite-logits check of generation (``TokenState._note_not_finite``): its cheap
form for greedy decoding (the chosen token's logit instead of a second pass over the vocabulary)
flags exactly the rows the row maximum flags, for NaN anywhere, +inf, rows all -inf and rows
already stopped, in float32 and bfloat16."""

import pytest
import torch

from mhe.generation.sampling import Rule, SamplingConfig, TokenState


def rows(dtype):
    """Eight rows of 50 logits: finite; NaN first, middle, last; +inf; all -inf; -inf but one;
    finite with some -inf."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 50, generator=g).to(dtype)
    x[1, 0] = x[2, 25] = x[3, 49] = float("nan")
    x[4, 7] = float("inf")
    x[5] = float("-inf")
    x[6] = float("-inf")
    x[6, 3] = 1.0
    x[7, ::2] = float("-inf")
    return x


def reference(logits, done):
    """The check as first written: the row maximum is not finite in a running row."""
    return bool((~torch.isfinite(logits.amax(-1)) & ~done).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_argmax", [True, False], ids=["greedy", "maximum"])
def test_each_row_alone_is_flagged_as_its_maximum_says(dtype, use_argmax):
    x = rows(dtype)
    for i in range(len(x)):
        for stopped in (False, True):
            state = TokenState(1, 4, torch.device("cpu"))
            state.done.fill_(stopped)
            state.count.fill_(2)
            row = x[i:i + 1]
            state._note_not_finite(row, row.argmax(-1) if use_argmax else None)
            expected = reference(row, state.done)
            assert (int(state.bad) == 2) == expected, (i, stopped)
            assert expected == (i in (1, 2, 3, 4, 5) and not stopped)


@pytest.mark.parametrize("use_argmax", [True, False], ids=["greedy", "maximum"])
def test_the_first_broken_step_is_kept(use_argmax):
    x = rows(torch.float32)
    state = TokenState(8, 4, torch.device("cpu"))
    state.done[1:6] = True  # every broken row has stopped: nothing is noted
    state._note_not_finite(x, x.argmax(-1) if use_argmax else None)
    assert int(state.bad) == -1
    state.done[2] = False
    state.count.fill_(1)
    state._note_not_finite(x, x.argmax(-1) if use_argmax else None)
    state.count.fill_(2)
    state._note_not_finite(x, x.argmax(-1) if use_argmax else None)
    assert int(state.bad) == 1  # the first step, not the latest


def test_argmax_points_at_a_nan():
    """What the greedy form relies on: argmax propagates NaN (as max does)."""
    x = rows(torch.bfloat16)
    assert torch.isnan(x.gather(-1, x.argmax(-1)[:, None])[1:4]).all()


def test_the_compiled_choice_notes_each_broken_row_and_chooses_as_eager():
    """In ``compile`` mode a greedy rule's choice is compiled (inductor): there the check reads the
    row maximum, fused with the argmax's pass. It flags the rows the reference flags, first step
    kept, and chooses, stops and advances as the eager choice does."""
    x = rows(torch.float32)
    rule = Rule(SamplingConfig(), stop_ids=(3,), stops=torch.tensor([3]))

    def run(choose):
        state = TokenState(8, 4, torch.device("cpu"))
        state.done[[1, 4]] = True  # two broken rows have stopped
        for step in range(3):
            rows_now = x if step == 1 else x.nan_to_num(0.0, 1.0, -1.0)  # broken at step 1 only
            choose(state, rows_now)
        return state
    eager = run(lambda s, lg: s.choose(lg, rule))
    torch._dynamo.reset()
    compiled = run(torch.compile(lambda s, lg: s.choose(lg, rule), fullgraph=True))
    assert int(compiled.bad) == 1 == int(eager.bad)
    for a, b in zip(compiled.tensors() + [compiled.out], eager.tensors() + [eager.out]):
        assert torch.equal(a, b)
