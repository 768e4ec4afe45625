"""One captured region per token: the choice of the next token and the stop bookkeeping run on the
device inside the step (the host loop adds no work per token), sampling draws what
``torch.multinomial`` draws, compiled steps equal eager ones token for token, and the default
sessions that ``generate`` reuses without a caller-held one."""

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhe.models import build_model
from mhe.generation import session as generate_module
from mhe.generation.step import ONE_ROW_COMPILE_OPTIONS, compile_step, default_compile_options
from mhe.generation.sampling import SamplingConfig, draw, filter_logits
from mhe.generation.session import release_default_sessions

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=2, max_len=40, dropout=0.0, attn_dropout=0.0)
AOT = {"backend": "aot_eager"}


def small(kind="mhe-mul"):
    model = build_model("tiny-decoder", attention=kind, **SMALL).double().eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "head_embed"):
                m.head_embed.normal_(0, 0.5)
    return model


class CountOps(TorchDispatchMode):
    """Counts the aten operators run, split by whether a region (``session.step``) is running."""

    def __init__(self):
        super().__init__()
        self.inside, self.outside, self.in_region = 0, 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.in_region:
            self.inside += 1
        else:
            self.outside += 1
        return func(*args, **(kwargs or {}))


def count_ops(model, session, ids, n, **kw):
    counter = CountOps()
    step = session.step

    def counted(rule):
        counter.in_region = True
        try:
            return step(rule)
        finally:
            counter.in_region = False
    session.step = counted
    with counter:
        model.generate(ids, n, session=session, **kw)
    del session.step
    return counter


@pytest.mark.parametrize("stops", [False, True])
def test_the_host_loop_adds_no_work_per_token(stops):
    """Besides one region per token, ``generate`` runs the same operators for 3 and for 19 new
    tokens (with stop tokens: plus one read of ``done`` every CHECK_EVERY tokens); the old loop
    ran the choice, the stop bookkeeping and the input copies outside the step, per token."""
    model = small()
    ids = torch.randint(3, 99, (2, 5))
    session = model.generator(2, 30, step_mode="eager")
    kw = dict(stop_ids=[1], min_new_tokens=2) if stops else {}  # token 1 never wins here: 19 tokens made
    model.generate(ids, 2, session=session, **kw)  # builds the region
    short, long = count_ops(model, session, ids, 3, **kw), count_ops(model, session, ids, 19, **kw)
    assert short.inside > 0 and long.inside * 2 == short.inside * 18  # 18 regions against 2
    checks = 2 * (19 // 8) if stops else 0  # all(), then the read of its answer
    assert long.outside == short.outside + checks


def test_draw_is_torch_multinomial():
    """The three-kernel draw gives torch.multinomial's tokens from the same generator state, a
    private one or the global one (so a seeded call gives transformers' sampled tokens, which come
    from multinomial)."""
    greedy = 0
    for seed in range(6):
        logits = torch.randn(3, 57) * 2
        probs = filter_logits(logits, SamplingConfig(do_sample=True, top_k=20, top_p=0.9)).softmax(-1)
        a = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed)).squeeze(-1)
        assert torch.equal(draw(probs, torch.Generator().manual_seed(seed)), a)
        torch.manual_seed(seed)
        b = torch.multinomial(probs, 1).squeeze(-1)
        torch.manual_seed(seed)
        assert torch.equal(draw(probs), b)
        greedy += int((a == probs.argmax(-1)).sum())
    assert greedy < 18  # draws, not the argmax


@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
def test_compiled_sampling_with_stops_equals_eager(kind):
    """The compiled step with the eager choice in one region: sampled tokens (temperature, top-k,
    top-p, a seed), stop tokens held back by min_new_tokens, why each row stopped, and the float64
    logits to 1e-12, as the eager region gives them; a left-padded batch."""
    model = small(kind)
    ids = torch.randint(3, 99, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0
    kw = dict(attention_mask=mask, do_sample=True, temperature=0.8, top_k=20, top_p=0.9, seed=5, return_dict=True,
              return_logits=True)
    free = model.generate(ids, 12, step_mode="eager", **kw)
    stop = int(free.tokens[0, 9])  # row 0's fourth new token: a stop the rows reach
    torch._dynamo.reset()
    session = model.generator(2, 18, step_mode="compile", compile_options=AOT)
    for least in (0, 4):  # 4: the stop is held back at first
        want = model.generate(ids, 12, step_mode="eager", stop_ids=[stop], pad_id=0, min_new_tokens=least, **kw)
        got = model.generate(ids, 12, session=session, stop_ids=[stop], pad_id=0, min_new_tokens=least, **kw)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.new_tokens, want.new_tokens)
        assert torch.equal(got.stopped, want.stopped)
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-12, atol=1e-12)
        assert least or (want.finish_reasons()[0] == "stop" and int(want.new_tokens[0]) <= 4)
    again = model.generate(ids, 12, step_mode="eager", stop_ids=[stop], pad_id=0, min_new_tokens=4, **kw)
    assert torch.equal(again.tokens, want.tokens)  # the seed, not the call count, decides


def test_compile_step_gives_each_step_its_own_compile_cache():
    """Twelve steps of one code object compile twelve graphs: none falls back to eager at
    dynamo's limit of 8 graphs per code object."""
    def make(k):
        def step(x):
            return x * k + 1
        return step
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    outs = [compile_step(make(k), device=torch.device("cpu"), options={"backend": "eager"})(torch.ones(2))
            for k in range(12)]
    assert int(torch._dynamo.utils.counters["stats"]["unique_graphs"]) == 12
    assert [float(o[0]) for o in outs] == [k + 1.0 for k in range(12)]


def test_a_step_the_compiler_fails_on_runs_eagerly_with_one_warning(monkeypatch):
    model = small()
    ids = torch.randint(3, 99, (2, 5))
    want = model.generate(ids, 6, step_mode="eager")

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no working C compiler\nsecond line")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    with pytest.warns(RuntimeWarning, match=r"cannot compile this decode step \(RuntimeError: no working C "
                                            r"compiler\); it runs its eager kernels"):
        got = model.generate(ids, 6, session=model.generator(2, 11, step_mode="compile"))
    assert torch.equal(got, want)


def test_one_row_cuda_steps_default_to_coordinate_descent_and_nothing_else_does():
    """Coordinate-descent tuning is the default of a compiled step of one row on CUDA only: two
    rows, a CPU, or options the caller gave (even empty ones) keep theirs; the default is a copy,
    so a caller's edit of a session's options cannot change the next session's."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    got = default_compile_options(1, cuda, None)
    assert got == {"options": {"coordinate_descent_tuning": True}} == ONE_ROW_COMPILE_OPTIONS
    got["options"]["coordinate_descent_tuning"] = False
    assert default_compile_options(1, cuda, None)["options"]["coordinate_descent_tuning"] is True
    assert default_compile_options(2, cuda, None) is None and default_compile_options(1, cpu, None) is None
    given = {"backend": "aot_eager"}
    assert default_compile_options(1, cuda, given) is given and default_compile_options(1, cuda, {}) == {}
    assert small().generator(1, 18, step_mode="compile").compile_options is None  # a CPU session


def test_a_default_session_given_the_one_row_options_is_still_reused(monkeypatch):
    """A one-row session on CUDA fills in its compile options; the default-session registry must
    still find it for the next call that gives none (else every default batch-1 ``generate`` on a
    GPU would build and compile a new session). Here the default applies on the CPU too."""
    model = small("mqa")
    monkeypatch.setattr(generate_module, "default_compile_options",
                        lambda rows, device, given: dict(ONE_ROW_COMPILE_OPTIONS) if given is None else given)
    ids = torch.randint(3, 99, (1, 5))
    model.generate(ids, 6)
    (first,) = generate_module._DEFAULT[model]
    assert first.compile_options == ONE_ROW_COMPILE_OPTIONS and first.options["compile_options"] is None
    model.generate(ids, 4)
    assert generate_module._DEFAULT[model] == [first]
    release_default_sessions(model)


def test_default_sessions_are_reused_bounded_and_go_with_the_model():
    model = small("mqa")
    attributes = set(vars(model))
    ids = torch.randint(3, 99, (2, 5))
    model.generate(ids, 6)
    (first,) = generate_module._DEFAULT[model]
    assert first.max_len == SMALL["max_len"]  # 11 rounded up to 64, at most the model's 40 positions
    model.generate(ids, 1)  # fits (6 <= 40 <= 2 x 6 rounded up): reused
    model.generate(ids[:, :3], 9)
    assert generate_module._DEFAULT[model] == [first]
    model.generate(ids[:1], 4)  # another batch size: a second session
    model.generate(ids, 4, step_mode="eager", kernel="eager")  # other options: a third; two are kept
    held = generate_module._DEFAULT[model]
    assert len(held) == 2 and first not in held and held[-1].kernel == "eager"
    assert set(vars(model)) == attributes  # nothing on the model
    release_default_sessions(model)
    assert model not in generate_module._DEFAULT
    model.generate(ids, 2)
    ref = weakref.ref(model)
    del model, held, first
    gc.collect()
    assert ref() is None  # the session did not keep it alive


def test_a_direct_prefill_builds_no_training_graph():
    """``Generator.prefill`` called outside ``model.generate`` (as a benchmark or a server loop
    might) runs without autograd, as ``generate`` does: its logits carry no ``grad_fn`` and equal
    ``generate``'s first logits. Without the guard the prefill keeps every activation for a
    backward pass (the probe that ran a long prefill out of memory did this)."""
    model = small()
    ids = torch.randint(3, 99, (2, 7))
    want = model.generate(ids, 1, step_mode="eager", return_logits=True)[1][:, 0]
    session = model.generator(2, 12, step_mode="eager")
    mask = torch.ones_like(ids, dtype=torch.bool)
    got = session.prefill(ids, mask, torch.arange(7).expand(2, 7), 1)
    assert got.grad_fn is None and not got.requires_grad
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["mha", "mhe-mul"])
def test_a_long_prefill_is_compiled_at_its_second_call_in_compile_mode(kind, monkeypatch):
    """From ``PREFILL_COMPILE_TOKENS`` a ``compile`` session compiles its prefill for the prompt's
    shape at the shape's second call and runs that compile from then on: float64 logits to 1e-12
    of an eager session's, for ragged left-padded and for unpadded prompts, in a Llama-style
    decoder (rotary positions). A shape's first call, and every call of an ``eager`` session,
    runs eagerly; the compiled prefills are kept by shape like the captured ones."""
    monkeypatch.setattr(generate_module, "PREFILL_GRAPH_TOKENS", 2 * 5)
    monkeypatch.setattr(generate_module, "PREFILL_COMPILE_TOKENS", 2 * 9)
    torch.manual_seed(0)
    model = build_model("llama-tiny", attention=kind).double().eval()
    ids = torch.randint(3, 200, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    eager, fast = model.generator(2, 20, step_mode="eager"), model.generator(2, 20, step_mode="compile",
                                                                              compile_options=AOT)
    for args in ((ids, mask), (ids, None), (ids[:, :4], None)):  # the last: 8 tokens, under the limit
        kw = dict(attention_mask=args[1], return_logits=True)
        want, wl = model.generate(args[0], 5, session=eager, **kw)
        for calls in range(3):
            got, gl = model.generate(args[0], 5, session=fast, **kw)
            assert torch.equal(got, want)
            torch.testing.assert_close(gl, wl, rtol=1e-12, atol=1e-12)
            key = (2, args[0].shape[1], args[1] is not None)
            assert (key in fast.compiled_prefills.runners) == (calls > 0 and args[0].shape[1] == 9), (key, calls)
    assert all(type(r).__name__ == "_CompiledStep" and not r.fell_back for r in fast.compiled_prefills.runners.values())
    assert sorted(fast.compiled_prefills.runners) == [(2, 9, False), (2, 9, True)]
    assert not fast.prefills.runners and not eager.compiled_prefills.runners


def test_kernel_time_tuning_asks_the_autotuner_for_the_profiler_clock_only_inside_the_block(monkeypatch):
    """Inside ``kernel_time_tuning()`` every call of inductor's autotuner ``bench`` asks for the
    profiler's clock (whatever its caller asked); after the block, and with ``on=False``, the
    original method is back and the caller's choice goes through; of two blocks that overlap
    (threads), the last to leave puts the original back."""
    from torch._inductor.runtime import triton_heuristics

    from mhe.generation.step import kernel_time_tuning

    seen = []

    def bench(self, launcher, *args, with_profiler=False, **kwargs):
        seen.append(with_profiler)
        return 1.0

    monkeypatch.setattr(triton_heuristics.CachingAutotuner, "bench", bench)
    tuner = triton_heuristics.CachingAutotuner
    with kernel_time_tuning():
        tuner.bench(object(), "launcher", 3, with_profiler=False)
        tuner.bench(object(), "launcher")
    tuner.bench(object(), "launcher")
    with kernel_time_tuning(False):
        tuner.bench(object(), "launcher")
    assert seen == [True, True, False, False] and tuner.bench is bench
    first, second = kernel_time_tuning(), kernel_time_tuning()  # two threads' blocks, interleaved
    first.__enter__()
    try:
        second.__enter__()
    finally:
        first.__exit__(None, None, None)
    try:
        tuner.bench(object(), "launcher")  # the other block still runs: the kernel's clock
    finally:
        second.__exit__(None, None, None)
    tuner.bench(object(), "launcher")
    assert seen[4:] == [True, False] and tuner.bench is bench  # the last block out put it back


@pytest.mark.parametrize("device, options, want", [
    ("cuda", ONE_ROW_COMPILE_OPTIONS, [True, False]),  # the first call compiles and tunes: the kernel's clock
    ("cuda", {}, [False, False]),  # no coordinate descent, nothing tuned
    ("cpu", ONE_ROW_COMPILE_OPTIONS, [False, False]),  # no Triton autotuner on a CPU
])
def test_a_step_tuned_by_coordinate_descent_tunes_by_kernel_time(monkeypatch, device, options, want):
    """A step compiled with coordinate-descent tuning on CUDA runs its first call (where inductor
    compiles and tunes its kernels) with the autotuner on the kernel-time clock, and later calls
    without; other steps never change the autotuner. (``torch.compile`` is replaced by the
    identity here, so the step runs on the CPU.)"""
    from torch._inductor.runtime import triton_heuristics

    original = triton_heuristics.CachingAutotuner.bench
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    patched = []

    def step(x):
        patched.append(triton_heuristics.CachingAutotuner.bench is not original)
        return x + 1
    run = compile_step(step, device=torch.device(device), options=options)
    for _ in range(2):
        assert torch.equal(run(torch.ones(2)), torch.full((2,), 2.0))
    assert patched == want and triton_heuristics.CachingAutotuner.bench is original


def test_long_prefills_between_the_limits_and_past_the_session_s_budget_run_eagerly(monkeypatch):
    """A ``compile`` session compiles no prefill of fewer than ``PREFILL_COMPILE_TOKENS`` tokens
    (above ``PREFILL_GRAPH_TOKENS``: eager), and at most ``PREFILL_COMPILES`` prompt shapes in
    all: a later long shape runs eagerly however often it comes, while the compiled ones keep
    running their compiles; new weights drop the compiles and what the session had seen, and the
    spent budget stays spent."""
    monkeypatch.setattr(generate_module, "PREFILL_GRAPH_TOKENS", 4)
    monkeypatch.setattr(generate_module, "PREFILL_COMPILE_TOKENS", 2 * 6)
    monkeypatch.setattr(generate_module, "PREFILL_COMPILES", 2)
    ran, real = [], generate_module.compile_step

    def counted(region, **kw):  # the compiled prefill, as a region that says when it runs
        if kw.get("what") != "prefill":
            return real(region, **kw)  # the decode step

        def run(*inputs):
            ran.append(inputs[0].shape[1])
            return region(*inputs)
        run.fell_back = False
        return run
    monkeypatch.setattr(generate_module, "compile_step", counted)
    model = small()
    fast = model.generator(2, 20, step_mode="compile", compile_options=AOT)
    ids = torch.randint(3, 99, (2, 9))
    for p in (5, 5, 5, 9, 9, 7, 7, 8, 8, 8, 9, 7):  # 10 tokens: under the compile limit; 14-18: over it
        model.generate(ids[:, :p], 2, session=fast)
    assert sorted(fast.compiled_prefills.runners) == [(2, 7, False), (2, 9, False)] and fast.prefill_compiles == 2
    assert ran == [9, 7, 9, 7]  # each compiled shape from its second call on; 8 never
    assert fast.prefills_seen == {(2, 7, False), (2, 9, False)}
    with torch.no_grad():
        model.lm_head.weight.mul_(1.0)  # new weights (a new version): a new view
    model.generate(ids, 2, session=fast)
    assert not fast.compiled_prefills.runners and not fast.prefills_seen and fast.prefill_compiles == 2


def test_a_prefill_the_compiler_fails_on_runs_eagerly_with_a_warning_naming_it(monkeypatch):
    """A long prefill whose compile fails warns once, naming the prefill, and gives the eager
    prefill's logits."""
    monkeypatch.setattr(generate_module, "PREFILL_GRAPH_TOKENS", 4)
    monkeypatch.setattr(generate_module, "PREFILL_COMPILE_TOKENS", 10)
    model = small()
    ids = torch.randint(3, 99, (2, 7))
    want = model.generate(ids, 1, step_mode="eager", return_logits=True)[1]

    def broken(fn, **kw):
        def run(*a):
            raise RuntimeError("no working C compiler")
        return run
    monkeypatch.setattr(torch, "compile", broken)
    fast = model.generator(2, 12, step_mode="compile")
    model.generate(ids, 1, session=fast)  # the shape's first call: eager
    with pytest.warns(RuntimeWarning, match=r"cannot compile this prefill"):
        got = model.generate(ids, 1, session=fast, return_logits=True)[1]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
