"""CUDA graphs for the compiled training step (``train.cuda_graphs``): when the trainer replays
the step as graphs (CPU: the decision), and that a replayed step trains exactly as the compiled
step without graphs does (GPU, ``pytest -m gpu``)."""

import pytest
import torch

from mhe.errors import MheError
from mhe.tasks import TASKS
from mhe.settings import check_fields
from mhe.training.config import TrainConfig
from mhe.training.parallelize import cuda_graphs_wanted, parallelize

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("setting, device, static, mode, want", [
    ("auto", CUDA, True, "ddp", True),     # pre-training on a GPU: on
    ("auto", CUDA, False, "ddp", False),   # variable-length batches: one graph per shape, off
    ("auto", CUDA, True, "fsdp", False),   # FSDP's hooks gather and free shards between blocks
    ("auto", CPU, True, "ddp", False),     # no CUDA graphs on a CPU
    (True, CUDA, False, "ddp", True),      # asked for
    (False, CUDA, True, "ddp", False),     # refused
])
def test_cuda_graphs_follow_the_setting_the_device_and_the_batch_shapes(setting, device, static, mode, want):
    t = TrainConfig(cuda_graphs=setting)
    assert cuda_graphs_wanted(t, device, static_shapes=static, mode=mode) is want


def test_no_cuda_graphs_without_compilation():
    t = TrainConfig(compile=False, cuda_graphs=True)
    assert cuda_graphs_wanted(t, CUDA, static_shapes=True) is False


def test_no_cuda_graphs_under_gradient_accumulation_and_asking_for_them_is_refused():
    """A replayed backward writes each micro-batch's gradients into the same graph memory, which
    accumulation would read as the running sum: auto stays off, true is a one-line error."""
    from mhe.tasks import default_run
    from mhe.training.config import apply_overrides

    assert cuda_graphs_wanted(TrainConfig(grad_accum=2), CUDA, static_shapes=True) is False
    with pytest.raises(MheError, match=r"train.cuda_graphs=true needs train.grad_accum=1, got 2"):
        apply_overrides(default_run("lm", "tiny-decoder", "mha"), ["train.cuda_graphs=true", "train.grad_accum=2"])
    cfg = apply_overrides(default_run("lm", "tiny-decoder", "mha"), ["train.cuda_graphs=auto", "train.grad_accum=2"])
    assert cfg.train.grad_accum == 2


def test_only_the_pretraining_tasks_declare_one_batch_shape():
    assert TASKS["lm"].static_shapes and TASKS["mlm"].static_shapes
    assert not TASKS["mt"].static_shapes and not TASKS["finetune"].static_shapes


def test_a_bad_cuda_graphs_value_is_one_line_naming_it():
    with pytest.raises(MheError, match="cuda_graphs"):
        check_fields(TrainConfig(cuda_graphs="sometimes"), "train")


def _train(cuda_graphs: bool, steps: int = 6):
    """Losses, weights and the CUDA runtime calls of the last step of a compiled tiny-decoder run."""
    from torch.profiler import ProfilerActivity, profile

    from mhe.models import build_model
    from mhe.training.distributed import Dist

    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention="mhe-mul", dropout=0.0, attn_dropout=0.0).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start = [p.detach().clone() for p in model.parameters()]
    t = TrainConfig(compile=True, cuda_graphs=cuda_graphs)
    step = parallelize(model, t, Dist(rank=0, world=1, local_rank=0, device=CUDA), static_shapes=True,
                       note=print).step
    ids = torch.randint(0, model.cfg.vocab_size, (steps, 4, 32), generator=torch.Generator().manual_seed(1)).cuda()
    losses = []

    def one(i):
        def micro(net):
            loss = net(ids[i], labels=ids[i], return_logits=False).loss
            loss.backward()
            return loss.detach().clone()
        losses.append(step.run(micro))
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(steps - 1):
        one(i)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one(steps - 1)
    calls = {e.key for e in prof.key_averages()}
    moved = max((p.detach() - p0).abs().max().item() for p, p0 in zip(model.parameters(), start))
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], calls, moved


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_replayed_step_trains_as_the_compiled_step():
    """The graphs replay the compiled step's kernels: the float32 losses of six steps agree to
    1e-6 (a graph replaying a stale batch or gradient would differ from the second step on).
    The weights agree to 5e-5 but for at most one entry in a thousand: AdamW's normalised update
    turns the last-bit differences of near-zero gradient entries (the embedding's atomic adds are
    not deterministic on CUDA) into differences of ~1e-5 after six steps at lr 1e-3, and now and
    then a sign flipped near zero into more (one entry of 65,536 at 6.4e-5 in one GPU run), but
    never more than the six updates of 1e-3 can move it; a stale step moves most entries by ~1e-3."""
    plain_losses, plain_weights, plain_calls, moved = _train(False)
    torch._dynamo.reset()
    graph_losses, graph_weights, graph_calls, _ = _train(True)
    assert "cudaGraphLaunch" in graph_calls and "cudaGraphLaunch" not in plain_calls
    torch.testing.assert_close(graph_losses, plain_losses, rtol=1e-6, atol=1e-6)
    for a, b in zip(graph_weights, plain_weights):
        diff = (a - b).abs()
        assert diff.gt(5e-5).float().mean().item() <= 1e-3, diff.gt(5e-5).sum().item()
        assert diff.max().item() <= 2 * 6 * 1e-3 + 1e-6  # two sets of six AdamW updates of lr 1e-3
    assert moved > 1e-3  # the weights did move (random tokens: the loss need not fall)


def test_a_cuda_graphs_request_that_cannot_apply_is_noted_and_the_run_trains(tmp_path):
    """On a CPU ``train.cuda_graphs=true`` cannot apply: one line says so and the run trains."""
    from mhe.tasks import default_run
    from mhe.tasks.recall import RecallTask
    from mhe.training.config import apply_overrides
    from mhe.training.loop import Trainer

    cfg = apply_overrides(default_run("recall", "tiny-decoder", "mha"), [
        "model.d_model=32", "model.d_ff=64", "model.n_layers=1", "train.batch_size=8", "train.steps=2",
        'data.task_options={"train_size": 32, "test_size": 8, "pairs": 2, "queries": 2}', "train.progress=false",
        "train.device=cpu", "train.cuda_graphs=true", "train.keep_checkpoints=false"])
    lines = []
    result = Trainer(cfg, RecallTask(), tmp_path / "run", log=lines.append).fit()
    assert [m for m in lines if "train.cuda_graphs=true has no effect here" in m]
    assert result["step"] == 2


@pytest.mark.parametrize("vocab, static", [(1000, True), (25_000, False)])
def test_an_adaptive_softmax_lm_is_not_one_shape(vocab, static):
    """A CPU-sized preset over a word-level vocabulary of 20,000 or more gets an adaptive softmax,
    whose per-cluster rows change with every batch: no CUDA graphs for it."""
    from mhe.tasks import default_run
    from mhe.tasks.lm import CausalLMTask
    from mhe.training.distributed import Dist

    task = CausalLMTask()
    task.tok = type("Tok", (), {"get_vocab_size": lambda self: vocab})()
    model = task._build_model(default_run("lm", "tiny-decoder", "mha"), Dist())
    assert bool(model.cfg.adaptive_cutoffs) is not static and task.static_shapes is static
