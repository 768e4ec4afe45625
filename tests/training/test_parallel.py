"""What several processes share, checked on one: activation checkpointing changes what is kept,
never what is computed; ``train.parallel`` is a checked setting, refused in one line where it
cannot apply, and neither setting changes which run a configuration is; a signal is agreed on
(one process alone is its own agreement), and torchrun's forwarded copy of Ctrl-C is not a
second signal. (Two processes: tests/training/test_fsdp.py, tests/training/test_ddp.py.)

The gradients with checkpointing must equal those without bit for bit (the recomputation repeats
the same operations, dropout included: the random state is restored before it). The count of
sublayer calls shows the recomputation happens: a checkpointed block runs its forward twice.
"""

import pytest
import torch

from conftest import B, D_MODEL, N_HEADS, T, VOCAB
from mhe.errors import MheError
from mhe.models import build_model
from mhe.tasks.recall import RecallTask
from mhe.training.activation_checkpointing import apply_activation_checkpointing, transformer_blocks
from mhe.training.config import apply_overrides
from mhe.tasks import default_run
from mhe.training.distributed import Dist
from mhe.training.loop import Trainer

N_LAYERS = 3


def model():
    torch.manual_seed(0)
    return build_model("tiny-decoder", attention="mhe-mul", vocab_size=VOCAB, d_model=D_MODEL, n_heads=N_HEADS,
                       d_ff=2 * D_MODEL, n_layers=N_LAYERS, dropout=0.1, attn_dropout=0.1)


def grads_and_calls(mode: str):
    m = model().train()
    assert apply_activation_checkpointing(m, mode) == {"none": 0, "full": N_LAYERS, "selective": 2}[mode]
    calls = [0]
    for block in transformer_blocks(m):
        block.self_attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)  # the dropout masks
    loss = m(ids, labels=ids, return_logits=False).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in m.named_parameters()}, calls[0], m


def test_checkpointing_changes_no_loss_or_gradient_and_recomputes_the_blocks_it_names():
    loss, grads, calls, plain = grads_and_calls("none")
    assert calls == N_LAYERS
    for mode, recomputed in (("full", N_LAYERS), ("selective", 2)):  # selective: blocks 0 and 2
        loss_m, grads_m, calls_m, m = grads_and_calls(mode)
        assert calls_m == N_LAYERS + recomputed  # the checkpointed blocks ran their forward again
        assert torch.equal(loss_m, loss)
        assert grads_m.keys() == grads.keys()
        for k in grads:
            assert torch.equal(grads_m[k], grads[k]), (mode, k)
        assert m.state_dict().keys() == plain.state_dict().keys()  # names unchanged: checkpoints load either way
    m = model()
    apply_activation_checkpointing(m, "full")
    with torch.no_grad():  # evaluation: one forward per block
        calls = [0]
        transformer_blocks(m)[0].self_attn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        m.eval()(torch.randint(0, VOCAB, (B, T)))
    assert calls == [1]


def test_parallel_and_checkpointing_are_checked_settings_outside_the_run_identity():
    base = default_run("recall", "tiny-decoder", "mha")
    other = apply_overrides(default_run("recall", "tiny-decoder", "mha"),
                            ["train.parallel=fsdp", "train.activation_checkpointing=selective"])
    assert other.hash() == base.hash()  # how a run is carried out, not what it computes: resumable either way
    with pytest.raises(MheError, match=r"train.parallel='zero' is not allowed; train.parallel takes one of auto, ddp, fsdp"):
        apply_overrides(default_run("recall", "tiny-decoder", "mha"), ["train.parallel=zero"])
    with pytest.raises(MheError, match="train.activation_checkpointing='some' is not allowed"):
        apply_overrides(default_run("recall", "tiny-decoder", "mha"), ["train.activation_checkpointing=some"])


def test_fsdp_on_one_process_is_refused_before_anything_is_written(tmp_path):
    cfg = apply_overrides(default_run("recall", "tiny-decoder", "mha"), ["train.parallel=fsdp", "train.device=cpu"])
    with pytest.raises(MheError, match=r"train.parallel=fsdp shards the model over several processes and this run "
                                       r"has one; launch it with torchrun --nproc_per_node N"):
        Trainer(cfg, RecallTask(), tmp_path / "run").fit()
    assert not (tmp_path / "run").exists()


def test_one_process_agrees_with_itself_on_a_signal():
    assert Dist().agreed_signal(None) is None and Dist().agreed_signal(15) == 15


def test_a_forwarded_copy_of_the_first_signal_is_not_a_second_one(monkeypatch):
    """Ctrl-C reaches torchrun's workers twice (terminal and torchrun): within a second, the same
    signal counts once; a later or different one stops at once."""
    import signal

    from mhe.training import run_log

    now = [100.0]
    monkeypatch.setattr(run_log.time, "monotonic", lambda: now[0])
    watch = run_log.SignalWatch()
    watch._on_signal(signal.SIGINT, None)
    now[0] += 0.2
    watch._on_signal(signal.SIGINT, None)  # the forwarded copy
    assert watch.signal == signal.SIGINT
    with pytest.raises(KeyboardInterrupt):
        watch._on_signal(signal.SIGTERM, None)
    now[0] += 2.0
    with pytest.raises(KeyboardInterrupt):
        watch._on_signal(signal.SIGINT, None)


def test_the_weightless_copy_holds_the_full_weights_while_filled_and_none_after():
    """FSDP's readers (evaluation, best/, checkpoints, results) see this copy: the same module with
    the same weights, tied ones tied (one parameter), and no memory of its own outside the block."""
    from mhe.training.fsdp import FullCopy

    m = model().eval()
    copy = FullCopy(m, torch.device("cpu"))
    assert all(p.is_meta for p in copy.module.parameters())
    ids = torch.randint(0, VOCAB, (B, T))
    with copy.filled(m) as full:
        assert full.lm_head.weight is full.decoder.embed.tokens.weight
        assert sum(p.numel() for p in full.parameters()) == sum(p.numel() for p in m.parameters())
        assert full.state_dict().keys() == m.state_dict().keys()
        for k, v in m.state_dict().items():
            assert torch.equal(full.state_dict()[k], v), k
        assert torch.equal(full.eval()(ids).logits, m(ids).logits)
    assert all(p.is_meta for p in copy.module.parameters())
    assert copy.module.lm_head.weight is copy.module.decoder.embed.tokens.weight


def test_parallelize_checkpoints_then_compiles_and_the_optimiser_trains_what_the_steps_update():
    """One process: activation checkpointing is applied to the blocks the compiled module runs
    (compile wraps the checkpointed model), and the optimiser is built on the parameters of
    the module the steps call, each once."""
    from torch._dynamo.eval_frame import OptimizedModule

    from mhe.training.config import TrainConfig
    from mhe.training.parallelize import parallelize

    m, notes = model(), []
    t = TrainConfig(compile=True, activation_checkpointing="selective")
    ready = parallelize(m, t, Dist(), static_shapes=True, note=notes.append)
    assert ready.mode == "none" and ready.copy is None and ready.model is m
    assert isinstance(ready.step.net, OptimizedModule) and ready.step.net._orig_mod is m
    assert [getattr(b, "_checkpointed", False) for b in transformer_blocks(m)] == [True, False, True]
    assert notes == ["activation checkpointing (selective): 2 block(s) recompute their activations"]
    opt, _ = ready.optimizer(t)
    trained = [p for g in opt.param_groups for p in g["params"]]
    assert len({id(p) for p in trained}) == len(trained) == len({id(p) for p in m.parameters()})
    with ready.full() as full:
        assert full is m  # without FSDP the readers of weights see the model itself
