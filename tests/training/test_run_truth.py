"""A run folder never lies about what it holds, and settings that cannot apply are refused.

``--init-from`` trains the source run's model (a preset, kind or ``model.*`` setting that
differs is one line naming every difference, before any folder is written); a setting that
cannot apply in this process (``train.parallel=ddp`` without torchrun) and an option and a
``--set`` item that set one value differently are refused; ``mhe generate --input`` with bytes
that are not UTF-8 is one line; a checkpoint a resume skips is set aside, never overwritten.
"""

from __future__ import annotations

import pytest

from conftest import require_data
from mhe.cli import main
from mhe.tasks import build_run, default_run, read_run_config
from mhe.tasks.init_from import continued_run
from mhe.tasks.recall import RecallTask
from mhe.training import checkpoint as ckpt
from mhe.training.config import apply_overrides
from mhe.training.loop import Trainer


def _refused(argv, capsys, *named, out=None):
    """``argv`` exits 2 with one line on stderr holding every ``named`` text; ``out`` not created."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    for text in named:
        assert text in err, err
    if out is not None:
        assert not out.exists()
    return err


# ---------------------------------------------------------------- --init-from: the source's model
@pytest.mark.parametrize("extra, named", [
    (["--preset", "llama-tiny"], ["--preset llama-tiny (the source's: tiny-decoder)"]),
    (["--set", "model.n_layers=2", "--set", "model.norm=rmsnorm"],
     ["model.n_layers=2 (the source's: 1)", "model.norm=rmsnorm (the source's: layernorm)"]),
    (["--set", "model.attn_options.init_std=0.05"], ["model.attn_options.init_std=0.05 (the source's: 0.02)"]),
    (["--preset", "tiny-decoder", "--attention", "mha", "--set", "model.activation=relu"],
     ["--attention mha (the source's: mhe-mul", "mhe convert", "model.activation=relu (the source's: gelu"]),
])
def test_init_from_refuses_a_model_that_differs_from_the_source(lm_run, tmp_path, capsys, extra, named):
    out = tmp_path / "continued"
    cheap = ["--data-dir", str(require_data("ptb/ptb.train.txt.gz")), "--set", "train.steps=1",
             "--set", "data.limit_lines=50", "--set", "train.progress=false"]  # were it accepted (as before)
    err = _refused(["pretrain", "--init-from", str(lm_run), "--data", "ptb", "--out", str(out), *extra, *cheap],
                   capsys, f"--init-from {lm_run} trains the source run's model", *named, out=out)
    assert "only model.dropout, model.attn_dropout, model.attn_kernel may change" in err


def test_init_from_keeps_the_source_model_and_takes_run_settings(lm_run):
    from mhe.tasks.init_from import RUN_SETTINGS

    source = read_run_config(lm_run)
    same = [f"model.{k}={v}" for k, v in (("n_layers", 1), ("d_model", 32), ("max_len", 32))]
    run = build_run("lm", source.preset, attention=source.kind, data="ptb", overrides=same + ["model.dropout=0"])
    cfg = continued_run(run, source, same + ["model.dropout=0", "model.attn_kernel=eager"], run=str(lm_run),
                        preset="tiny-decoder", attention="mhe-mul")
    assert cfg.preset == source.preset == "tiny-decoder"
    assert cfg.model.replace(dropout=source.model.dropout, attn_kernel=source.model.attn_kernel) == source.model
    assert (cfg.model.dropout, cfg.model.attn_kernel) == (0.0, "eager")
    assert RUN_SETTINGS == ("dropout", "attn_dropout", "attn_kernel")


# ---------------------------------------------------------------- settings that cannot apply here
def test_ddp_without_torchrun_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    _refused(["train", "--task", "recall", "--preset", "tiny-decoder", "--out", str(out), "--set", "train.steps=1",
              "--set", "train.parallel=ddp", "--set", "train.device=cpu"], capsys,
             "train.parallel=ddp copies the model to several processes and this run has one", "torchrun", out=out)


# ---------------------------------------------------------------- an option and a --set item
@pytest.mark.parametrize("argv, named", [
    (["train", "--task", "recall", "--preset", "tiny-decoder", "--seed", "3", "--set", "train.seed=5"],
     "--seed 3 and --set train.seed=5 disagree"),
    (["train", "--task", "recall", "--preset", "tiny-decoder", "--attention", "mqa", "--set", "model.attention=mha"],
     "--attention mqa and --set model.attention=mha disagree"),
    (["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--set", "data.dataset=wikitext-2"],
     "--data ptb and --set data.dataset=wikitext-2 disagree"),
    (["train-mt", "--preset", "tiny-encoder-decoder", "--src", "de", "--set", "data.task_options.src=fr"],
     "--src de and --set data.task_options.src=fr disagree"),
    (["finetune", "--task", "rte", "--run", "{tmp}/none", "--seeds", "2", "--set", "train.seed=4"],
     "--set train.seed=4 clashes with this command's own train.seed, set by --seeds 2"),
    (["compare", "--preset", "cpu-recall", "--kinds", "mqa", "--seeds", "1", "--set", "model.attention=mha"],
     "--set model.attention=mha clashes with this command's own model.attention, set by --kinds"),
    (["compare", "--preset", "cpu-recall", "--kinds", "mqa", "--seeds", "1", "--set", "train.seed=2"],
     "--set train.seed=2 clashes with this command's own train.seed, set by --seeds"),
], ids=["seed", "attention", "data", "src", "finetune-seeds", "compare-kinds", "compare-seeds"])
def test_an_option_and_a_set_item_that_disagree_are_refused(argv, named, tmp_path, capsys):
    out = tmp_path / "out"
    cheap = ["--set", "train.steps=1", "--set", "train.progress=false"]  # were it accepted (as before), it stays short
    _refused([a.replace("{tmp}", str(tmp_path)) for a in argv] + cheap + ["--out", str(out)], capsys, named, out=out)


def test_an_option_and_a_set_item_that_agree_are_one_value():
    cfg = build_run("recall", "tiny-decoder", seed=3, overrides=["train.seed=3"], flags={"train.seed": ("--seed", 3)})
    assert cfg.train.seed == 3
    cfg = build_run("recall", "tiny-decoder", overrides=["train.seed=5"], flags={})  # no --seed: the item sets it
    assert cfg.train.seed == 5


# ---------------------------------------------------------------- generate --input
def test_generate_input_that_is_not_utf8_is_one_line(lm_run, tmp_path, capsys):
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"the company\nsaid \xff\xfe it\n")
    _refused(["generate", "--run", str(lm_run), "--input", str(bad), "--max-new-tokens", "2"], capsys,
             f"{bad}: line 2: byte 17 (0xff) is not UTF-8")


# ---------------------------------------------------------------- a skipped checkpoint is kept aside
SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1",
         'data.task_options={"train_size": 256, "test_size": 64, "pairs": 4, "queries": 4}',
         "train.batch_size=16", "train.steps=8", "train.log_every=1", "train.save_every=4", "train.progress=false",
         "train.warmup_steps=2"]


def test_a_checkpoint_a_resume_skips_is_set_aside_not_overwritten(tmp_path):
    def cfg(*extra):
        return apply_overrides(default_run("recall", "tiny-decoder", "mha"), SMALL + list(extra))

    Trainer(cfg("train.stop_at=8"), RecallTask(), tmp_path, log=lambda *_: None).fit()
    (tmp_path / "results.json").unlink(missing_ok=True)
    newest = ckpt.list_checkpoints(tmp_path / "checkpoints")[-1]
    assert newest.name == "step-00000008"
    weights = newest / "model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[-1] ^= 0xFF
    weights.write_bytes(bytes(damaged))
    messages = []
    Trainer(cfg(), RecallTask(), tmp_path, resume=True, log=messages.append).fit()
    aside = tmp_path / "checkpoints" / "step-00000008.rejected-corrupt"
    assert (aside / "model.safetensors").read_bytes() == bytes(damaged)  # the evidence, as it was
    assert any(f"kept the skipped checkpoint step-00000008 aside as {aside}" == m for m in messages), messages
    assert any("resuming from" in m and "step-00000004" in m for m in messages), messages
    assert ckpt.verify(newest) is None  # step 8 trained again, beside the rejected folder
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")] == ["step-00000004", "step-00000008"]


def test_set_aside_never_replaces_an_earlier_rejected_folder(tmp_path):
    for n in range(2):
        (tmp_path / "step-00000004").mkdir()
        (tmp_path / "step-00000004" / "mark").write_text(str(n))
        ckpt.set_aside(tmp_path / "step-00000004", "state")
    assert (tmp_path / "step-00000004.rejected-state" / "mark").read_text() == "0"
    assert (tmp_path / "step-00000004.rejected-state-2" / "mark").read_text() == "1"
    assert ckpt.list_checkpoints(tmp_path) == []
