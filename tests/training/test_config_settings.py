"""Typed settings: every bad ``--set`` value is a one-line error naming the key, the value
and what is allowed, raised when the configuration is built; good values parse to their
field's type; configurations saved in the earlier layout are refused, naming the migration."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mhe.cli import main
from mhe.errors import MheError
from mhe.experiments.run_archive import RunFiles
from mhe.attention import GroupedQueryOptions, MHEOptions, NoOptions
from mhe.training.config import DataConfig, RunConfig, apply_overrides
from mhe.tasks import default_run, run_config_from_dict
from mhe.tasks.finetune_config import FinetuneOptions
from mhe.tasks.recall import RecallOptions
from mhe.tasks.translation_config import TranslationOptions

NO_CUDA = not torch.cuda.is_available()


def base(task: str):
    """A default run of each task (fine-tuning without a checkpoint: none is read here)."""
    if task == "finetune":
        return RunConfig(task="finetune", preset="tiny-encoder",
                         data=DataConfig(dataset="rte", task_options=FinetuneOptions(task="rte", checkpoint="x")))
    return default_run(task, {"mt": "tiny-encoder-decoder", "mlm": "tiny-encoder"}.get(task, "tiny-decoder"), "mha",
                       {"lm": "ptb", "mlm": "ptb", "mt": "multi30k"}.get(task, ""))


# (items, task, the key named, the bad value as the message shows it)
BAD = [
    # train.*: issue 16's examples first
    (["train.lr=NaN"], "lm", "train.lr", "nan"),
    (["train.log_every=0"], "lm", "train.log_every", "0"),
    (["train.betas=[2,3]"], "lm", "train.betas", "2.0"),
    (["train.betas=5"], "lm", "train.betas", "5"),
    (["train.device=gpu"], "lm", "train.device", "gpu"),
    (["train.steps=2.5"], "lm", "train.steps", "2.5"),
    (["train.save_every=-1"], "lm", "train.save_every", "-1"),
    (["train.weight_decay=-1"], "lm", "train.weight_decay", "-1"),
    (["train.lr=inf"], "lm", "train.lr", "inf"),
    (["train.lr=-1e-3"], "lm", "train.lr", "-0.001"),
    (["train.lr=0"], "lm", "train.lr", "0"),
    (["train.lr=fast"], "lm", "train.lr", "fast"),
    (["train.betas=[0.9]"], "lm", "train.betas", "0.9"),
    (["train.betas=[0.9,\"a\"]"], "lm", "train.betas[1]", "a"),
    (["train.betas=[0.9,1.0]"], "lm", "train.betas", "1.0"),
    (["train.device=cuda:7"], "lm", "train.device", "cuda:7"),
    (["train.device=tpu"], "lm", "train.device", "tpu"),
    (["train.steps=0"], "lm", "train.steps", "0"),
    (["train.steps=-5"], "lm", "train.steps", "-5"),
    (["train.steps=many"], "lm", "train.steps", "many"),
    (["train.eval_every=-2"], "lm", "train.eval_every", "-2"),
    (["train.batch_size=0"], "lm", "train.batch_size", "0"),
    (["train.batch_size=8.5"], "lm", "train.batch_size", "8.5"),
    (["train.grad_accum=0"], "lm", "train.grad_accum", "0"),
    (["train.schedule=wavy"], "lm", "train.schedule", "wavy"),
    (["train.precision=fp16"], "lm", "train.precision", "fp16"),
    (["train.grad_reduce=fp16"], "lm", "train.grad_reduce", "fp16"),
    (["train.parallel=fsdp", "train.grad_reduce=bf16"], "lm", "train.grad_reduce", "bf16"),
    (["train.warmup_steps=-1"], "lm", "train.warmup_steps", "-1"),
    (["train.warmup_ratio=1.5"], "lm", "train.warmup_ratio", "1.5"),
    (["train.eps=0"], "lm", "train.eps", "0"),
    (["train.clip_norm=-0.5"], "lm", "train.clip_norm", "-0.5"),
    (["train.label_smoothing=1"], "lm", "train.label_smoothing", "1"),
    (["train.seed=-1"], "lm", "train.seed", "-1"),
    (["train.keep_last=0"], "lm", "train.keep_last", "0"),
    (["train.stop_at=-3"], "lm", "train.stop_at", "-3"),
    (["train.patience=-1"], "lm", "train.patience", "-1"),
    (["train.compile=maybe"], "lm", "train.compile", "maybe"),
    (["train.progress=2"], "lm", "train.progress", "2"),
    (["train.epochs=-1"], "lm", "train.epochs", "-1"),
    (["train.epochs=nan"], "lm", "train.epochs", "nan"),
    (["train.restarts=0"], "lm", "train.restarts", "0"),
    # data.*
    (["data.seq_len=-1"], "lm", "data.seq_len", "-1"),
    (["data.eval_stride=-256"], "lm", "data.eval_stride", "-256"),
    (["data.eval_stride=0"], "lm", "data.eval_stride", "0"),
    (["data.vocab_size=-5"], "lm", "data.vocab_size", "-5"),
    (["data.vocab_size=big"], "lm", "data.vocab_size", "big"),
    (["data.limit_lines=1.5"], "lm", "data.limit_lines", "1.5"),
    (["data.eval_batch_size=0"], "lm", "data.eval_batch_size", "0"),
    (["data.source=cloud"], "lm", "data.source", "cloud"),
    (["data.eval_precision=bf16"], "lm", "data.eval_precision", "bf16"),
    (["data.tokenizer=sentencepiece"], "lm", "data.tokenizer", "sentencepiece"),
    # model.*
    (["model.dropout=1.5"], "lm", "model.dropout", "1.5"),
    (["model.dropout=abc"], "lm", "model.dropout", "abc"),
    (["model.dropout=-0.1"], "lm", "model.dropout", "-0.1"),
    (["model.attn_dropout=1"], "lm", "model.attn_dropout", "1"),
    (["model.n_heads=0"], "lm", "model.n_heads", "0"),
    (["model.n_layers=-1"], "lm", "model.n_layers", "-1"),
    (["model.d_model=2.5"], "lm", "model.d_model", "2.5"),
    (["model.d_model=30"], "lm", "model.d_model", "30"),
    (["model.d_ff=NaN"], "lm", "model.d_ff", "nan"),
    (["model.attention=nope"], "lm", "model.attention", "nope"),
    (["model.positions=alibi"], "lm", "model.positions", "alibi"),
    (["model.attention=linear", "model.positions=rotary"], "lm", "model.positions", "rotary"),
    (["model.positions=rotary", "model.rope_fraction=0.01"], "lm", "rope_fraction", "0.01"),
    (["model.rope_base=1"], "lm", "model.rope_base", "1"),
    (["model.norm=batchnorm"], "lm", "model.norm", "batchnorm"),
    (["model.mlp=geglu"], "lm", "model.mlp", "geglu"),
    (["model.layer_norm_eps=0"], "lm", "model.layer_norm_eps", "0"),
    (["model.tie_embeddings=yes"], "lm", "model.tie_embeddings", "yes"),
    (["model.head_dim=-4"], "lm", "model.head_dim", "-4"),
    (["model.max_len=0"], "lm", "model.max_len", "0"),
    (["model.adaptive_cutoffs=5"], "lm", "model.adaptive_cutoffs", "5"),
    (["model.adaptive_cutoffs=[1,\"x\"]"], "lm", "model.adaptive_cutoffs[1]", "x"),
    (["model.adaptive_cutoffs=[500,100]"], "lm", "model.adaptive_cutoffs", "500"),
    (["model.head=qa"], "lm", "head", "qa"),
    # model.attn_options.*: each kind's typed options
    (["model.attention=gqa", "model.attn_options.n_kv_heads=-1"], "lm", "model.attn_options.n_kv_heads", "-1"),
    (["model.attention=gqa", "model.attn_options.n_kv_heads=3"], "lm", "model.attn_options.n_kv_heads", "3"),
    (["model.attn_options.n_kv_heads=two", "model.attention=gqa"], "lm", "model.attn_options.n_kv_heads", "two"),
    (["model.attention=mhe-mul", "model.attn_options.impl=slow"], "lm", "model.attn_options.impl", "slow"),
    (["model.attention=mhe-add", "model.attn_options.query_fold=sideways"], "lm", "model.attn_options.query_fold",
     "sideways"),
    (["model.attention=mhe-mul", "model.attn_options.init_std=-1"], "lm", "model.attn_options.init_std", "-1"),
    (["model.attention=mhe-mul", "model.attn_options.rope_order=sideways"], "lm", "model.attn_options.rope_order",
     "sideways"),
    (["model.attention=mhe-mul", "model.attn_options.init_std=inf"], "lm", "model.attn_options.init_std", "inf"),
    (["model.attention=linear", "model.attn_options.max_len=0"], "lm", "model.attn_options.max_len", "0"),
    (["model.attention=gqa", "model.attn_options=5"], "lm", "model.attn_options", "5"),
    (["model.attention=gqa", 'model.attn_options={"n_kv_heads": -2}'], "lm", "model.attn_options.n_kv_heads", "-2"),
    # data.task_options.*: each task's typed options
    (["data.task_options.pairs=0"], "recall", "data.task_options.pairs", "0"),
    (["data.task_options.pairs=64"], "recall", "data.task_options.pairs", "64"),
    (["data.task_options.queries=9"], "recall", "data.task_options.queries", "9"),
    (["data.task_options.train_size=-1"], "recall", "data.task_options.train_size", "-1"),
    (["data.task_options.data_seed=1.5"], "recall", "data.task_options.data_seed", "1.5"),
    (["data.task_options.beam=0"], "mt", "data.task_options.beam", "0"),
    (["data.task_options.alpha=nan"], "mt", "data.task_options.alpha", "nan"),
    (["data.task_options.protocol=last3"], "mt", "data.task_options.protocol", "last3"),
    (["data.task_options.max_tokens=-4096"], "mt", "data.task_options.max_tokens", "-4096"),
    (["data.task_options.eval_sentences=0"], "mt", "data.task_options.eval_sentences", "0"),
    (["data.task_options.test_sentences=-1"], "mt", "data.task_options.test_sentences", "-1"),
    (["data.task_options.decode_dtype=float16"], "mt", "data.task_options.decode_dtype", "float16"),
    (["data.task_options.decode_tokens=0"], "mt", "data.task_options.decode_tokens", "0"),
    (['data.task_options={"beam": 0}'], "mt", "data.task_options.beam", "0"),
    (["data.task_options=[1,2]"], "mt", "data.task_options", "[1, 2]"),
    (["data.task_options.doc_stride=0"], "finetune", "data.task_options.doc_stride", "0"),
    (["data.task_options.train_limit=-1"], "finetune", "data.task_options.train_limit", "-1"),
    (["data.task_options.max_answer_len=abc"], "finetune", "data.task_options.max_answer_len", "abc"),
]


@pytest.mark.parametrize("items, task, key, shown", BAD, ids=[" ".join(c[0]) for c in BAD])
def test_bad_setting_is_one_line_naming_key_and_value(items, task, key, shown):
    with pytest.raises(MheError) as e:
        apply_overrides(base(task), items)
    msg = str(e.value)
    assert "\n" not in msg
    assert key in msg and shown.lower() in msg.lower(), msg
    assert any(w in msg for w in ("takes", "must", "valid")), msg  # says what is allowed


def test_the_table_is_large():
    assert len(BAD) >= 60


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_one_line():
    with pytest.raises(MheError, match=r"^train.device='cuda' is not available: this machine has no CUDA device"):
        apply_overrides(base("lm"), ["train.device=cuda"])


@pytest.mark.parametrize("item, valid", [
    ("train.lrr=1", "valid train keys: steps, epochs"),
    ("data.colour=red", "valid data keys: dataset, data_dir"),
    ("model.colour=red", "valid model keys: arch, vocab_size"),
    ("model.attn_options.n_kv_heads=2", "valid model.attn_options keys: none"),
    ("data.task_options.beam=2", "valid data.task_options keys: n_keys, n_values"),
    ("model.dropout.x=1", "model.dropout has no sub-keys"),
])
def test_unknown_keys_list_the_valid_ones(item, valid):
    with pytest.raises(MheError, match=valid):
        apply_overrides(base("recall"), [item])


def test_good_values_parse_to_their_types():
    cfg = apply_overrides(base("lm"), [
        "train.lr=3e-4", "train.steps=1e3", "train.betas=[0.9, 0.98]", "train.compile=TRUE", "train.epochs=2",
        "train.schedule=cosine", "train.device=cpu", "model.head_dim=16", "model.adaptive_cutoffs=[100, 200]",
        "model.dropout=0", "data.eval_stride=128", "data.tokenizer=word"])
    t = cfg.train
    assert (t.lr, t.steps, t.betas, t.compile, t.epochs) == (3e-4, 1000, (0.9, 0.98), True, 2.0)
    assert type(t.steps) is int and type(t.epochs) is float and type(t.betas) is tuple
    assert (cfg.model.head_dim, cfg.model.adaptive_cutoffs, cfg.model.dropout) == (16, [100, 200], 0.0)
    assert type(cfg.model.dropout) is float and cfg.data.eval_stride == 128 and cfg.data.tokenizer == "word"
    assert apply_overrides(cfg, ["model.head_dim=null"]).model.head_dim is None


@pytest.mark.parametrize("items", [
    ["model.attention=gqa", "model.attn_options.n_kv_heads=2"],
    ["model.attn_options.n_kv_heads=2", "model.attention=gqa"],  # the kind applies first
    ["model.attention=gqa", 'model.attn_options={"n_kv_heads": 2}'],
])
def test_the_kind_lives_in_the_model_with_typed_options(items):
    cfg = apply_overrides(base("lm"), items)
    assert cfg.model.attention == cfg.kind == "gqa" and cfg.model.attn_options == GroupedQueryOptions(n_kv_heads=2)
    assert not hasattr(cfg, "attention")
    assert cfg.model.attention_config(causal=True).options.n_kv_heads == 2
    # another kind starts from its own defaults
    assert apply_overrides(cfg, ["model.attention=mqa"]).model.attn_options == NoOptions()
    mhe = apply_overrides(base("lm"), ["model.attention=mhe-mul", "model.attn_options.impl=reference"])
    assert mhe.model.attn_options == MHEOptions(impl="reference")


def test_task_options_are_typed_and_merge():
    mt = apply_overrides(base("mt"), ['data.task_options={"src": "de", "tgt": "en"}', "data.task_options.beam=2",
                                      'data.task_options={"alpha": 1}'])
    assert mt.data.task_options == TranslationOptions(src="de", tgt="en", beam=2, alpha=1.0)
    assert type(mt.data.task_options.alpha) is float
    recall = apply_overrides(base("recall"), ["data.task_options.pairs=16"])
    assert recall.data.task_options == RecallOptions(pairs=16)
    assert base("finetune").data.task_options == FinetuneOptions(task="rte", checkpoint="x")


# A saved run (config.json's "run") as the trainer writes it.
SAVED_RECALL = json.loads(json.dumps(default_run("recall", "tiny-decoder", "gqa").to_dict()))


def test_a_saved_configuration_in_the_earlier_layout_names_the_migration():
    old = {"task": "recall", "preset": "tiny-decoder", "attention": "gqa", "model": {"d_model": 32}}
    with pytest.raises(MheError, match=r"^x/config.json: saved in an earlier layout .*; convert it with: "
                                       r"python benchmarks/results_tools.py migrate"):
        run_config_from_dict(old, source="x/config.json")


def test_a_saved_run_of_this_repository_loads():
    exp = Path(__file__).parent.parent.parent / "results" / "lm-ptb"  # its runs packed in runs.tar.xz
    if not exp.exists():
        pytest.skip("no saved results in this checkout")
    saved = RunFiles(exp).config("mha-seed0")
    cfg = run_config_from_dict(saved["run"], source="test")
    resolved = {k: v for k, v in saved["model"].items() if k not in ("vocab_size", "attn_options")}
    mine = {k: v for k, v in cfg.model.to_dict().items() if k in resolved}
    assert mine == resolved  # the preset plus the recorded overrides is the model the run built


@pytest.mark.parametrize("bad, match", [
    ({**SAVED_RECALL, "colour": 1}, "unknown run configuration key 'colour'"),
    ({**SAVED_RECALL, "train": {"lr": "fast"}}, "train.lr='fast' is not allowed"),
    ({**SAVED_RECALL, "data": {"eval_stride": -1}}, "data.eval_stride=-1 is out of range"),
    ({**SAVED_RECALL, "data": {"task_options": {"pairs": 0}}}, "data.task_options.pairs=0 is out of range"),
    ({**SAVED_RECALL, "task": "nope"}, "unknown task 'nope'"),
    ({k: v for k, v in SAVED_RECALL.items() if k != "preset"}, "needs 'preset'"),
    ([1, 2], "must be a JSON object"),
])
def test_bad_saved_configuration_is_one_line(bad, match):
    with pytest.raises(MheError, match=match):
        run_config_from_dict(bad, source="test")


CLI_BAD = ["train.lr=NaN", "model.dropout=abc", "model.attn_options.n_kv_heads=3", "data.seq_len=-1",
           "train.device=gpu", "train.betas=5", "train.grad_reduce=fp16"]


@pytest.mark.parametrize("item", CLI_BAD)
def test_cli_bad_setting_exits_2_before_any_work(item, tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--attention", "gqa", "--out", str(out),
            "--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and item.split("=")[0] in err[0] and "Traceback" not in err[0]
    assert not out.exists()


def test_cli_set_model_attention_works():
    from mhe.tasks import build_run

    cfg = build_run("lm", "tiny-decoder", attention="mha", data="ptb", seed=3, overrides=["model.attention=mqa"])
    assert cfg.model.attention == "mqa" and cfg.train.seed == 3


@pytest.mark.slow  # a real process each (about 2 s): the in-process table covers the messages
@pytest.mark.parametrize("item", ["train.log_every=0", "model.attention=mqq"])
def test_python_m_mhe_bad_setting(item, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mhe", "pretrain", "--preset", "tiny-decoder", "--data", "ptb",
                           "--out", str(out), "--set", item], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and item.split("=")[1] in lines[0] and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("argv", [["params", "--preset", "bert-base", "--kinds", ""],
                                  ["compare", "--kinds", " , "]])
def test_empty_kind_list_is_refused(argv, capsys):
    assert main(argv) == 2
    assert "names no attention kind" in capsys.readouterr().err


# a value other than the default for every field of a kind's options
OPTION_VALUES = {"n_kv_heads": 2, "impl": "reference", "init_std": 0.5, "query_fold": "activation", "max_len": 64,
                 "rope_order": "psi-then-rope"}


@pytest.mark.parametrize("kind", ["mha", "mqa", "gqa", "mhe-mul", "mhe-add", "linear", "fnet"])
def test_every_attention_option_reaches_the_sublayers(kind):
    """One schema: ``model.attn_options`` is the dataclass every sublayer is built with, and each
    of its fields set by ``--set`` reaches them (a dropped option fails here)."""
    import dataclasses

    from mhe.attention import Attention, build_attention, options_class
    from mhe.models import build_model

    names = [f.name for f in dataclasses.fields(options_class(kind))]
    built = build_attention(kind, d_model=32, n_heads=4)
    assert set(names) <= set(OPTION_VALUES) and options_class(kind) is built.spec.options
    items = [f"model.attention={kind}"] + [f"model.attn_options.{k}={OPTION_VALUES[k]}" for k in names]
    cfg = apply_overrides(base("mlm" if kind == "fnet" else "lm"), items)
    assert {k: getattr(cfg.model.attn_options, k) for k in names} == {k: OPTION_VALUES[k] for k in names}
    model = build_model(cfg.model.replace(d_model=32, d_ff=64, n_layers=2, vocab_size=99))
    mods = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(mods) == 2 and all(m.kind == kind and m.cfg.options == cfg.model.attn_options for m in mods)
    g = {"mha": 4, "mqa": 1, "gqa": 2}.get(kind)
    if g:  # the kind fixes the key/value heads (mha, mqa) or takes them from its options (gqa)
        assert all(m.n_kv_heads == g and m.k_proj.out_features == g * 8 for m in mods)
    if kind.startswith("mhe-"):
        assert all(m.reference and m.cfg.options.query_fold == "activation" for m in mods)
    if kind == "linear":  # its own max_len wins; without one the sublayer takes the model's
        assert all(m.seq_mix.shape == (64, 64) for m in mods)
        plain = build_model(cfg.model.replace(attn_options=None, d_model=32, d_ff=64, n_layers=1, vocab_size=99))
        assert [m.seq_mix.shape[0] for m in plain.modules() if isinstance(m, Attention)] == [cfg.model.max_len]


# A comparison folder written before experiments were typed records their --set items.
OLD_GPU_PTB = {"task": "lm", "preset": "gpt2-base", "kinds": ["sha", "mha"], "seeds": 3, "data": "ptb",
               "overrides": ["model.n_layers=6", "model.max_len=256", "data.vocab_size=16384", "train.steps=600",
                             "train.batch_size=32", "train.lr=5e-4", "train.warmup_steps=60", "train.schedule=cosine",
                             "train.eval_every=100", "train.save_every=100", "train.patience=3", "train.log_every=25",
                             "model.dropout=0.1", "model.attn_dropout=0.1", "data.tokenizer=word",
                             "train.keep_checkpoints=false"], "pretrained": ""}


def test_typed_experiment_matches_its_earlier_set_items(tmp_path):
    import argparse

    from mhe.cli.compare import build_sweep
    from mhe.experiments.sweep import Sweep, check_sweep_dir

    (tmp_path / "sweep.json").write_text(json.dumps({"sweep": OLD_GPU_PTB}))  # no "run": refused, naming the fix
    earlier = r"sweep.json was written by an earlier version \(no 'run', or its model as overrides\); convert its "
    with pytest.raises(MheError, match=earlier + r"folder with: python benchmarks/results_tools.py migrate"):
        check_sweep_dir(tmp_path, Sweep(**OLD_GPU_PTB))
    overrides = {**OLD_GPU_PTB, "run": {**Sweep(**OLD_GPU_PTB).shared_run(), "model": {"n_layers": 2}}}
    (tmp_path / "sweep.json").write_text(json.dumps({"sweep": overrides}))  # the earlier identity layout
    with pytest.raises(MheError, match=earlier):
        check_sweep_dir(tmp_path, Sweep(**OLD_GPU_PTB))
    record = {**OLD_GPU_PTB, "run": Sweep(**OLD_GPU_PTB).shared_run()}  # the --set items on the task's defaults
    (tmp_path / "sweep.json").write_text(json.dumps({"sweep": record}))

    def sweep(*items):
        args = argparse.Namespace(task=None, preset="gpu-ptb", kinds="sha,mha", seeds=5, data=None, data_dir="",
                                  set=list(items), paper=None, pretrained="")
        return build_sweep(args)[1]

    check_sweep_dir(tmp_path, sweep("train.save_every=0"))  # more seeds, another cadence: the same comparison
    with pytest.raises(MheError, match=r"train.steps: 600 there, 700 now"):
        check_sweep_dir(tmp_path, sweep("train.steps=700"))


def test_one_list_of_architectures_and_heads():
    from mhe.accounting import ARCHS as counted
    from mhe.models import ARCHS, MODEL_CLASSES
    from mhe.models.config import HEADS

    assert counted is ARCHS and set(MODEL_CLASSES) == {(a, h) for a in ARCHS for h in HEADS[a]}


@pytest.mark.parametrize("stride", ["0", "-5"])
def test_eval_stride_is_checked_before_loading(stride, tmp_path, capsys):
    assert main(["eval", "--checkpoint", str(tmp_path / "none"), "--stride", stride]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--stride={stride} is out of range; --stride must be > 0" in err[0]


def test_build_run_sets_its_typed_arguments_without_parsing_text(monkeypatch):
    """``--attention``, ``--seed`` and the task options reach the configuration as values (the kind
    checked by ModelConfig, the rest by type and range), never as ``KEY=VALUE`` text parsed again;
    ``--set`` items are the only text."""
    import mhe.settings
    import mhe.training.config
    from mhe.tasks import build_run

    parsed, parse = [], mhe.settings.parse_text

    def recording(key, raw, tp):
        parsed.append(key)
        return parse(key, raw, tp)

    monkeypatch.setattr(mhe.settings, "parse_text", recording)
    monkeypatch.setattr(mhe.training.config, "parse_text", recording)
    cfg = build_run("recall", "tiny-decoder", attention="gqa", seed=3, task_options={"pairs": 2, "queries": 2})
    assert parsed == []
    assert cfg.model.attention == "gqa" and type(cfg.model.attn_options).__name__ == "GroupedQueryOptions"
    assert cfg.train.seed == 3 and cfg.data.task_options.pairs == 2
    build_run("recall", "tiny-decoder", attention="mqa", overrides=["train.lr=0.001"])
    assert parsed == ["train.lr"]
    with pytest.raises(MheError, match=r"^train.seed=-1 is out of range"):
        build_run("recall", "tiny-decoder", seed=-1)
