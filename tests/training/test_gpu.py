"""GPU checks (run with ``pytest -m gpu``): the fast path in bf16 on CUDA, on the flash kernel."""

import pytest
import torch

from mhe.attention import build_attention

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@cuda
@pytest.mark.parametrize("kind", ["mhe-add", "mhe-mul"])
def test_bf16_fast_path_error_within_twice_plain(kind):
    torch.manual_seed(0)
    fast = build_attention(kind, d_model=768, n_heads=12, causal=True).cuda()
    with torch.no_grad():
        fast.head_embed.normal_(0, 0.3)
    ref = build_attention(kind, d_model=768, n_heads=12, causal=True, impl="reference").cuda()
    ref.load_state_dict(fast.state_dict())
    x = torch.randn(4, 512, 768, device="cuda")
    gold = ref.double()(x.double())
    e_fast = rel(fast.bfloat16()(x.bfloat16()), gold)
    e_plain = rel(ref.bfloat16()(x.bfloat16()), gold)
    assert e_fast <= 2 * e_plain, (e_fast, e_plain)


@cuda
@pytest.mark.parametrize("kind", ["mqa", "gqa", "mhe-add", "mhe-mul"])
def test_one_kv_head_stays_on_flash_attention(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    opts = {"n_kv_heads": 4} if kind == "gqa" else {}
    mod = build_attention(kind, d_model=768, n_heads=12, causal=True, **opts).cuda().bfloat16()
    x = torch.randn(2, 256, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):  # raises if flash cannot take these inputs
        mod(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


@cuda
@pytest.mark.parametrize("kind", ["mha", "gqa", "mhe-mul"])
def test_graph_decode_equals_eager_on_cuda(kind):
    """A replayed CUDA graph runs the eager kernels: tokens and logits are bit-identical."""
    from mhe.models import build_model
    from mhe.generation.beam import beam_search

    torch.manual_seed(0)
    opts = {"n_kv_heads": 2} if kind == "gqa" else {}
    model = build_model("tiny-decoder", attention=kind, attn_options=opts, dropout=0.0,
                        attn_dropout=0.0).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    for m in (None, mask):
        a, la = model.generate(ids, 20, attention_mask=m, session=model.generator(3, 29, step_mode="eager"),
                               return_logits=True)  # the same cache length as the graph session's
        session = model.generator(3, 29, step_mode="graph")
        b, lb = model.generate(ids, 20, attention_mask=m, session=session, return_logits=True)
        c, lc = model.generate(ids, 20, attention_mask=m, session=session, return_logits=True)  # replayed again
        assert torch.equal(a, b) and torch.equal(la, lb) and torch.equal(b, c) and torch.equal(lb, lc)
    s2s = build_model("tiny-encoder-decoder", attention=kind, attn_options=opts, dropout=0.0,
                      attn_dropout=0.0).cuda().eval()
    src = torch.randint(3, 1024, (4, 7), device="cuda")
    smask = torch.ones_like(src, dtype=torch.bool)
    smask[1, 5:] = False
    e, se = beam_search(s2s, src, smask, bos_id=1, eos_id=2, beam=3, max_len=12, step_mode="eager",
                        return_scores=True)
    g, sg = beam_search(s2s, src, smask, bos_id=1, eos_id=2, beam=3, max_len=12, step_mode="graph",
                        return_scores=True)
    assert torch.equal(e, g) and torch.equal(se, sg)


SMALL_RECALL = ["model.d_model=64", "model.d_ff=128", "model.n_layers=2", "model.dropout=0", "model.attn_dropout=0",
                'data.task_options={"train_size": 256, "test_size": 64, "pairs": 4, "queries": 4, "n_keys": 48, '
                '"n_values": 50}', "train.batch_size=16", "train.steps=12", "train.log_every=3",
                "train.save_every=6", "train.progress=false", "train.warmup_steps=2"]


@cuda
def test_training_with_the_gpu_defaults_trains_resumes_and_saves_the_real_vocabulary(tmp_path):
    """On CUDA the trainer compiles, pads the vocabulary (99 -> 128), prefetches and uses fused
    AdamW by default: it trains like the eager step (bf16 either way), a stop and resume gives the
    same losses, and the saved weights have the real vocabulary."""
    from safetensors.torch import load_file

    from mhe.tasks.recall import RecallTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.loop import Trainer
    from mhe.training.run_files import read_metrics

    small = SMALL_RECALL + ["train.device=cuda"]

    def run(out, *extra, resume=False):
        cfg = apply_overrides(default_run("recall", "tiny-decoder", "mhe-mul"), small + list(extra))
        Trainer(cfg, RecallTask(), out, resume=resume, log=lambda *_: None).fit()
        return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]

    compiled = run(tmp_path / "a")
    eager = run(tmp_path / "b", "train.compile=false")
    assert compiled == pytest.approx(eager, rel=2e-2) and compiled[-1] < compiled[0]
    run(tmp_path / "c", "train.stop_at=6")
    # the same losses up to the GPU's non-deterministic reductions (bit-exact resume: the CPU tests)
    assert run(tmp_path / "c", resume=True) == pytest.approx(compiled, rel=1e-3)
    # and it resumed at step 6: a refused checkpoint is set aside, and a restart repeats the losses
    assert not list((tmp_path / "c" / "checkpoints").glob("*.rejected-*"))
    weights = load_file(str(tmp_path / "a" / "checkpoints" / "step-00000012" / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (99, 64)


@cuda
def test_a_cpu_runs_checkpoint_resumes_on_the_gpu_and_trains_on(tmp_path):
    """Stopped on the CPU at step 6, resumed on the GPU (fused AdamW, a padded vocabulary): it goes
    on from its checkpoint (none set aside; read onto the card, the random generators' states made
    every checkpoint refused), with the step counts on the card for fused AdamW, to step 12."""
    from mhe.tasks.recall import RecallTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.loop import Trainer
    from mhe.training.run_files import read_metrics

    messages = []

    def run(*extra, resume=False):
        cfg = apply_overrides(default_run("recall", "tiny-decoder", "mhe-mul"), SMALL_RECALL + list(extra))
        Trainer(cfg, RecallTask(), tmp_path, resume=resume, log=messages.append).fit()
    run("train.device=cpu", "train.stop_at=6")
    run("train.device=cuda", resume=True)
    assert any("resuming from" in m and "step-00000006" in m for m in messages), messages
    assert not list((tmp_path / "checkpoints").glob("*.rejected-*"))
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records][-1] == 12 and all(r["loss"] == r["loss"] for r in records)


@cuda
def test_train_deterministic_makes_compiled_gpu_runs_and_their_resumes_agree_bit_for_bit(tmp_path):
    """With ``train.deterministic=true`` two compiled runs on the card, and a third stopped at step 6
    and resumed, give the same losses and final weights to the bit. Without it compiled runs of
    this task differ (the 30-step kill trials of a smaller recall decoder: two uninterrupted runs'
    weights 2.4e-3 to 7.7e-3 apart; docs/benchmarks.md, "Kill safety"); this configuration has not
    been run without it, so that it differs here too is expected, not measured."""
    from safetensors.torch import load_file

    from mhe.tasks.recall import RecallTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.loop import Trainer
    from mhe.training.run_files import read_metrics

    small = SMALL_RECALL + ["train.device=cuda", "train.compile=true", "train.deterministic=true"]

    def run(out, *extra, resume=False):
        cfg = apply_overrides(default_run("recall", "tiny-decoder", "mhe-mul"), small + list(extra))
        Trainer(cfg, RecallTask(), out, resume=resume, log=lambda *_: None).fit()

    def losses_and_weights(out):
        weights = load_file(str(out / "checkpoints" / "step-00000012" / "model.safetensors"))
        return [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl")], weights

    run(tmp_path / "a")
    run(tmp_path / "b")
    run(tmp_path / "c", "train.stop_at=6")
    run(tmp_path / "c", resume=True)
    (a, wa), (b, wb), (c, wc) = (losses_and_weights(tmp_path / d) for d in "abc")
    assert not list((tmp_path / "c" / "checkpoints").glob("*.rejected-*"))
    assert a == b == c and len(a) == 4
    for name, w in wa.items():
        assert torch.equal(w, wb[name]) and torch.equal(w, wc[name]), name
    assert not torch.are_deterministic_algorithms_enabled()


@cuda
@pytest.mark.parametrize("kind", ["gqa", "mhe-mul"])
def test_llama_decoder_graph_decode_equals_eager_and_flash_decode_tracks_sdpa(kind):
    """The Llama-style decoder (RoPE) in bf16: graph replays equal eager steps bit for bit; MHE-Mul
    keeps one rotated K/V head, so it decodes with split-k-decode (flash-decode without Triton),
    within bf16 of SDPA decoding."""
    from mhe.models import build_model

    torch.manual_seed(0)
    model = build_model("llama-tiny", attention=kind).cuda().to(torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (3, 9), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    a, la = model.generate(ids, 20, attention_mask=mask, session=model.generator(3, 29, step_mode="eager"),
                           return_logits=True)  # the same cache length as the graph session's
    session = model.generator(3, 29, step_mode="graph")
    b, lb = model.generate(ids, 20, attention_mask=mask, return_logits=True, session=session)
    assert torch.equal(a, b) and torch.equal(la, lb)
    assert {c.k.shape[1] for c in session.caches} == {1 if kind == "mhe-mul" else 2}
    if kind == "mhe-mul":
        from mhe.attention import triton_decode

        chosen = "split-k-decode" if triton_decode.available() else "flash-decode"
        assert session.plan.kernel == chosen
        _, ls = model.generate(ids, 20, attention_mask=mask, return_logits=True,
                               session=model.generator(3, 29, step_mode="eager", kernel="sdpa"))
        assert torch.equal(la[:, 0], ls[:, 0])  # the prompt runs SDPA either way
        assert rel(la[:, 1], ls[:, 1]) < 2e-2  # the first decode step, from the same token


@cuda
def test_mhe_eval_runs_on_the_gpu_and_equals_the_cpu_figure(tmp_path, capsys):
    """``mhe eval`` puts the model on the GPU by default (``--device auto``): its float32 figure
    equals the CPU's to float32 rounding, the default TF32 products move it by about 1e-4 at most,
    and ``--precision train`` (bf16 autocast) by bf16 rounding only. A model left on the CPU, or a
    precision that does not apply, fails this."""
    import json

    from conftest import require_data
    from mhe.cli import main
    from tiny_runs import COMMON

    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    run = tmp_path / "lm"
    assert main(["train", "--task", "lm", "--preset", "tiny-decoder", "--attention", "mhe-mul", "--data", "ptb",
                 "--data-dir", str(root), "--out", str(run), *COMMON, "--set", "train.device=cpu",
                 "--set", "data.limit_lines=200", "--set", "train.batch_size=4", "--set", "model.max_len=32"]) == 0

    def nll(*extra):
        capsys.readouterr()
        assert main(["eval", "--run", str(run), "--data-dir", str(root), "--split", "valid", *extra]) == 0
        return json.loads(capsys.readouterr().out)["nll"]

    cpu = nll("--device", "cpu", "--precision", "float32")
    gpu, tf32, bf16 = nll("--precision", "float32"), nll(), nll("--precision", "train")
    assert gpu == pytest.approx(cpu, rel=1e-5)
    assert tf32 == pytest.approx(cpu, rel=1e-3)
    assert bf16 != pytest.approx(cpu, rel=1e-5) and bf16 == pytest.approx(cpu, rel=2e-2)


@pytest.mark.two_gpus
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices")
def test_translate_on_a_second_gpu_equals_the_first(mt_run, tmp_path, capsys):
    """``--device cuda:1`` makes cuda:1 the current device too: beam search captures its step as
    a CUDA graph on the current device and the split-k decode kernels launch there, so a model on
    cuda:1 with cuda:0 current would capture an empty graph or read foreign pointers. The output
    equals cuda:0's line for line."""
    from mhe.cli import main
    from test_option_effects import _mt_lines

    src = tmp_path / "src.txt"
    src.write_text("\n".join(_mt_lines()) + "\n")
    before = torch.cuda.current_device()
    outs = {}
    try:
        for dev in ("cuda:0", "cuda:1"):
            capsys.readouterr()
            assert main(["translate", "--run", str(mt_run), "--input", str(src), "--device", dev]) == 0
            outs[dev] = capsys.readouterr().out.splitlines()
            assert torch.cuda.current_device() == int(dev[-1])
    finally:
        torch.cuda.set_device(before)
    assert outs["cuda:1"] == outs["cuda:0"] and len(outs["cuda:0"]) == len(_mt_lines())
