"""Bad input on the newest paths (issue 63): each class is one line and exit 2 on the command line
(``MheError`` in the API), nothing left behind: an output that cannot be written (tried by creating
the temporary sibling the write will use, not guessed from permissions), a ``config.json`` that is
JSON but not an object, a partial ``torchrun`` environment, a cache setting that names a file, the
export API's unwritable place and failed write, malformed ``compile_options``, keyword mistakes of
``generate``/``beam_search``/``Generator``, and ``mhe run --config`` given a run folder's record."""

from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest
import torch

from mhe.cli import main
from mhe.errors import MheError
from mhe.models import build_model
from mhe.generation.beam import beam_search
from mhe.generation.session import generate

# /proc takes no new entries, though os.access says it is writable for root: the probe must try
UNWRITABLE = Path("/proc/mhe-no-such-folder")
needs_proc = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs a /proc that takes no new folders")


def _one_line(capsys, *parts):
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err
    return err


def _decoder():
    return build_model("tiny-decoder", vocab_size=40, d_model=16, d_ff=32, n_layers=1, n_heads=2, max_len=32).eval()


@needs_proc
@pytest.mark.parametrize("command", ["export", "convert", "train"])
def test_an_output_that_cannot_be_written_is_one_line_before_any_work(lm_run, command, capsys):
    args = {"export": ["export", "--run", str(lm_run), "--out", str(UNWRITABLE)],
            "convert": ["convert", "--checkpoint", str(lm_run), "--attention", "gqa", "--no-eval", "--out",
                        str(UNWRITABLE)],
            "train": ["train", "--task", "recall", "--preset", "tiny-decoder", "--out", str(UNWRITABLE / "run")]}
    assert main(args[command]) == 2
    _one_line(capsys, f"--out {UNWRITABLE}", "nothing can be written in /proc")


@needs_proc
def test_the_export_api_refuses_an_unwritable_place_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    from mhe.hf import save_model
    with pytest.raises(MheError, match=re.escape(f"--out {UNWRITABLE}: nothing can be written in /proc")):
        save_model(_decoder(), UNWRITABLE)
    # the place is writable, the write fails half way (a full disk): one line, no partial folder left
    import transformers

    def full_disk(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full_disk)
    with pytest.raises(MheError, match="the export could not be written \\(No space left on device\\)"):
        save_model(_decoder(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "3"])
def test_a_config_json_that_is_not_an_object_is_one_line(tmp_path, capsys, content):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(content)
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "gqa", "--out",
                 str(tmp_path / "conv")]) == 2
    _one_line(capsys, "config.json: must be a JSON object")
    assert not (tmp_path / "conv").exists()
    from mhe.hf import import_hf
    with pytest.raises(MheError, match="must be a JSON object"):
        import_hf(tmp_path / "hf")


@pytest.mark.parametrize("env, named", [({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 set, RANK, MASTER_ADDR, MASTER_PORT not"),
                                        ({"RANK": "1"}, "RANK=1 set, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not"),
                                        ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1"},
                                         "MASTER_PORT not")])
def test_a_partial_distributed_environment_is_one_line(tmp_path, monkeypatch, capsys, env, named):
    for key in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    assert main(["train", "--task", "recall", "--preset", "tiny-decoder", "--out", str(out),
                 "--set", "train.steps=1"]) == 2
    _one_line(capsys, "a partial distributed environment", named, "launch with torchrun")
    assert not out.exists()
    from mhe.training.distributed import setup
    with pytest.raises(MheError, match="a partial distributed environment"):
        setup("cpu")


def test_a_rendezvous_address_alone_is_noted_and_one_process_trains(tmp_path, monkeypatch, capsys):
    for key in ("WORLD_SIZE", "RANK", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    assert main(["train", "--task", "recall", "--preset", "tiny-decoder", "--out", str(tmp_path / "run"),
                 "--set", "train.steps=1", "--set", "model.n_layers=1", "--set", "train.progress=false"]) == 0
    err = capsys.readouterr().err
    assert "mhe train: note: MASTER_ADDR=10.0.0.1 set without WORLD_SIZE and RANK: one process" in err


def test_a_cache_setting_that_names_a_file_is_one_line_and_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    from conftest import require_data
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    (tmp_path / "cache").write_text("a file")
    for setting in (tmp_path / "cache", tmp_path / "cache" / "below"):
        monkeypatch.setenv("MHE_CACHE_DIR", str(setting))
        out = tmp_path / "run"
        assert main(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(root), "--out",
                     str(out), "--set", "train.steps=1", "--set", "data.limit_lines=50", "--set", "model.n_layers=1",
                     "--set", "model.max_len=16"]) == 2
        _one_line(capsys, f"MHE_CACHE_DIR={setting}: {tmp_path / 'cache'} is a file, not a folder")
        assert not out.exists()


@pytest.mark.parametrize("options, match", [
    ("fast", "compile_options must be a dict of torch.compile keywords (mode, options, backend, disable), got str"),
    ([1], "compile_options must be a dict"),
    ({"bogus": 1}, "compile_options has no key 'bogus'; valid: mode, options, backend, disable"),
    ({"mode": "nope"}, "unknown compile_options mode 'nope'; valid: default, reduce-overhead"),
    ({"options": "x"}, "compile_options['options'] must be a dict of inductor settings, got str"),
])
def test_malformed_compile_options_are_one_line_before_any_compilation(options, match):
    model, ids = _decoder(), torch.tensor([[1, 2, 3]])
    with pytest.raises(MheError, match=re.escape(match)):
        model.generate(ids, 2, step_mode="compile", compile_options=options)
    with pytest.raises(MheError, match=re.escape(match)):
        model.generator(1, 8, step_mode="compile", compile_options=options)


def test_keyword_mistakes_name_the_keyword_and_the_allowed_ones():
    model, ids = _decoder(), torch.tensor([[1, 2, 3]])
    with pytest.raises(MheError, match=r"^generate\(\) has no keyword 'beams'; valid: .*max_new_tokens, attention"):
        model.generate(ids, 2, beams=4)
    with pytest.raises(MheError, match=r"^generate\(\) has no keyword 'num_beams'; valid: .*do_sample, temperature"):
        generate(model, ids, 2, num_beams=4)
    with pytest.raises(MheError, match=r"^Generator\(\) has no keyword 'beams'; valid: .*step_mode, kernel"):
        model.generator(1, 8, beams=2)
    s2s = build_model("tiny-encoder-decoder", vocab_size=40, d_model=16, d_ff=32, n_layers=1, n_heads=2,
                      max_len=16).eval()
    with pytest.raises(MheError, match=r"^beam_search\(\) has no keyword 'beams'; valid: .*beam, max_len, alpha"):
        beam_search(s2s, ids, bos_id=1, eos_id=2, beams=4)
    assert generate(model, ids, 2).shape == (1, 5)  # the right keywords still work


def test_run_config_given_a_run_folders_config_json_points_at_run_json(lm_run, tmp_path, capsys):
    assert main(["run", "--config", str(lm_run / "config.json"), "--out", str(tmp_path / "again")]) == 2
    _one_line(capsys, "is a run folder's config.json (the record of a run), not a run configuration",
              "--config takes a run.json")
    assert not (tmp_path / "again").exists()
    assert json.loads((lm_run / "config.json").read_text())["run"]  # the record it pointed at


# ---------------------------------------------------------------- options the output ignores
def test_a_family_that_the_format_or_architecture_ignores_is_refused(lm_run, tmp_path, capsys):
    """--family picks a Llama-style class of --format standard: with remote-code, or for a GPT-2-shaped
    model, it would be dropped without a word."""
    assert main(["export", "--run", str(lm_run), "--out", str(tmp_path / "a"), "--family", "qwen2"]) == 2
    _one_line(capsys, "--family qwen2 applies to --format standard", "drop --family")
    assert main(["export", "--run", str(lm_run), "--out", str(tmp_path / "b"), "--format", "standard",
                 "--family", "llama"]) == 2
    _one_line(capsys, "--family llama chooses among Llama-style classes (rotary positions); this decoder")
    assert list(tmp_path.iterdir()) == []
    from mhe.hf import export_hf, save_model
    gpt2_shaped = build_model("gpt2-base", vocab_size=40, d_model=16, d_ff=32, n_layers=1, n_heads=2, max_len=16)
    with pytest.raises(MheError, match="family='mistral' chooses among Llama-style classes"):
        export_hf(gpt2_shaped, "mistral")
    with pytest.raises(MheError, match="--family llama applies to --format standard"):
        save_model(gpt2_shaped, tmp_path / "c", family="llama")
    assert list(tmp_path.iterdir()) == []


def test_convert_refuses_a_split_it_would_not_score_and_notes_an_alignment_it_would_not_do(lm_run, tmp_path, capsys):
    assert main(["convert", "--checkpoint", str(lm_run), "--attention", "gqa", "--no-eval", "--split", "test",
                 "--out", str(tmp_path / "a")]) == 2
    _one_line(capsys, "--split test names the split scored, and --no-eval scores none")
    assert not (tmp_path / "a").exists()
    pytest.importorskip("transformers")
    from test_convert_hf_folders import _llama
    _llama(tmp_path / "hf")
    capsys.readouterr()
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "gqa", "--naive", "--no-align",
                 "--out", str(tmp_path / "b")]) == 0
    assert "note: --no-align changes nothing here (--naive writes the mean of the heads" in capsys.readouterr().err


# ---------------------------------------------------------------- strict weight loading
def _add_tensors(folder, extra):
    from safetensors.torch import load_file, save_file
    state = load_file(folder / "model.safetensors")
    save_file({**state, **extra}, folder / "model.safetensors", metadata={"format": "pt"})


def test_stored_tensors_no_parameter_takes_are_refused_unless_named_as_skipped(tmp_path):
    """A BERT masked-LM folder may carry BERT's pooler and next-sentence head (bert-base does) and
    GPT-2's old causal-mask buffers: named skips, the logits unchanged. Any other tensor the model
    has no place for is refused, naming it."""
    transformers = pytest.importorskip("transformers")
    from mhe.hf import import_hf
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(cfg).eval()
    hf.save_pretrained(tmp_path / "bert")
    _add_tensors(tmp_path / "bert", {"bert.pooler.dense.weight": torch.randn(16, 16),
                                     "bert.pooler.dense.bias": torch.randn(16),
                                     "cls.seq_relationship.weight": torch.randn(2, 16),
                                     "bert.embeddings.position_ids": torch.arange(16)[None]})
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = import_hf(tmp_path / "bert").eval()(ids).logits, hf(ids).logits
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-5  # float32: the two libraries' kernels
    _add_tensors(tmp_path / "bert", {"bert.encoder.layer.1.output.dense.bias": torch.randn(16)})
    with pytest.raises(MheError, match=re.escape("stores weights config.json's model does not have "
                                                 "(bert.encoder.layer.1.output.dense.bias)")):
        import_hf(tmp_path / "bert")


def test_an_import_of_a_model_object_refuses_a_mapped_weight_no_parameter_takes():
    from mhe.hf.weights import load_exact
    model = torch.nn.Linear(2, 2)
    state = {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)}
    load_exact(model, state)
    extra = {f"extra{i}": torch.zeros(1) for i in range(7)}
    with pytest.raises(MheError, match=r"^source weights no parameter takes: extra0, extra1, extra2, extra3, extra4 "
                                       r"and 2 more$"):
        load_exact(model, {**state, **extra})
    with pytest.raises(MheError, match=r"^no source weight for bias$"):
        load_exact(model, {"weight": torch.zeros(2, 2)})
