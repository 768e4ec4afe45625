"""``mhe convert`` end to end: a tiny MHA run converted to each kind is a run folder that
``mhe eval``, ``generate``, ``pretrain --init-from`` and ``finetune`` take; a Hugging Face GPT-2
directory converts with its tokenizer; bad input is one line and exit 2."""

import json
import math

import pytest
import torch

from conftest import require_data
from mhe.cli import main
from mhe.training.weights import read_sealed_weights as model_weights
from mhe.training.checkpoint import latest_checkpoint

TINY = ["--set", "train.steps=4", "--set", "train.progress=false", "--set", "train.log_every=1",
        "--set", "data.limit_lines=200", "--set", "train.batch_size=4", "--set", "model.n_layers=1",
        "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.max_len=32",
        "--set", "model.n_heads=4"]


@pytest.fixture(scope="module")
def mha_run(tmp_path_factory):
    """A 4-step MHA language model on 200 lines of PTB (1 layer, width 32, window 32)."""
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    out = tmp_path_factory.mktemp("runs") / "mha"
    assert main(["pretrain", "--preset", "tiny-decoder", "--data", "ptb", "--data-dir", str(root),
                 "--out", str(out), *TINY]) == 0
    return out


@pytest.fixture(scope="module")
def converted(mha_run, tmp_path_factory):
    """mha_run converted to MHE-Mul (aligned, the default), with scores on the validation split."""
    out = tmp_path_factory.mktemp("conv") / "mhe-mul"
    assert main(["convert", "--checkpoint", str(mha_run), "--attention", "mhe-mul", "--out", str(out),
                 "--device", "cpu", "--calibration", "8"]) == 0
    return out


def test_convert_writes_a_run_folder_with_its_report(converted, mha_run, capsys):
    record = json.loads((converted / "config.json").read_text())
    assert record["run"]["model"]["attention"] == "mhe-mul" and record["model"]["attention"] == "mhe-mul"
    assert record["converted_from"]["attention"] == "mha"
    assert (converted / "tokenizer.json").read_text() == (mha_run / "tokenizer.json").read_text()
    report = json.loads((converted / "conversion.json").read_text())
    assert report["kind"] == "mhe-mul" and report["options"]["align"] is True
    for sub in report["errors"]:
        for role in ("query", "key", "value"):
            assert sub[role]["weight"]["fit"] < sub[role]["weight"]["naive"]
            assert "output" in sub[role]  # calibrated: errors on projected outputs too
    scores = report["scores"]
    assert scores["source"]["split"] == scores["converted"]["split"] == "valid"
    assert math.isfinite(scores["converted"]["perplexity"]) and scores["source"]["perplexity"] > 1


def test_eval_of_the_converted_folder_reproduces_the_reported_score(converted, capsys):
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(converted), "--split", "valid"]) == 0
    res = json.loads(capsys.readouterr().out)
    reported = json.loads((converted / "conversion.json").read_text())["scores"]["converted"]
    assert res["perplexity"] == pytest.approx(reported["perplexity"], rel=1e-9)


def test_generate_runs_on_the_converted_folder(converted, capsys):
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(converted), "--prompt", "the company", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the company")


@pytest.mark.parametrize("kind, extra", [("mqa", []), ("gqa", ["--n-kv-heads", "2"]), ("mhe-add", []), ("sha", [])])
def test_every_target_converts_and_evaluates(mha_run, tmp_path, capsys, kind, extra):
    out = tmp_path / kind
    assert main(["convert", "--checkpoint", str(mha_run), "--attention", kind, "--out", str(out), "--device", "cpu",
                 "--calibration", "8", *extra]) == 0
    text = capsys.readouterr().out
    assert "| sublayer" in text and "perplexity per word on the valid split" in text and f"wrote {out}" in text
    record = json.loads((out / "config.json").read_text())
    assert record["model"]["attention"] == kind
    if kind == "gqa":
        assert record["model"]["attn_options"]["n_kv_heads"] == 2


def test_pretrain_init_from_takes_the_converted_kind_and_weights(converted, tmp_path):
    root = require_data("ptb/ptb.train.txt.gz")
    out = tmp_path / "uptrain"
    assert main(["pretrain", "--init-from", str(converted), "--data", "ptb", "--data-dir", str(root),
                 "--out", str(out), "--set", "train.steps=3", "--set", "train.progress=false",
                 "--set", "data.limit_lines=200", "--set", "train.batch_size=4"]) == 0
    record = json.loads((out / "config.json").read_text())
    assert record["model"]["attention"] == "mhe-mul" and record["run"]["preset"] == "tiny-decoder"
    train = record["run"]["train"]
    assert train["warmup_ratio"] == pytest.approx(0.05)  # continued training's default warm-up
    # the run started from the converted weights: step 0 of a rebuilt run equals them
    from mhe.tasks.lm import CausalLMTask
    from mhe.tasks import run_config_from_dict
    from mhe.training.distributed import Dist

    cfg = run_config_from_dict(record["run"], source="config.json")
    model = CausalLMTask().setup(cfg, tmp_path / "again", Dist())
    source = model_weights(latest_checkpoint(converted / "checkpoints"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in source.items())


def test_pretrain_init_from_refuses_another_kind(converted, tmp_path, capsys):
    assert main(["pretrain", "--init-from", str(converted), "--attention", "mha", "--data", "ptb",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--attention mha" in err and "mhe convert" in err


@pytest.mark.slow
def test_finetune_takes_the_converted_folder(converted, tmp_path):
    root = require_data("glue/RTE/train.tsv.gz")
    opts = {"train_limit": 16, "dev_limit": 16}
    assert main(["finetune", "--task", "rte", "--checkpoint", str(converted), "--data-dir", str(root),
                 "--out", str(tmp_path / "rte"), "--set", "train.steps=2", "--set", "train.progress=false",
                 "--set", "train.batch_size=4", "--set", f"data.task_options={json.dumps(opts)}"]) == 0
    res = json.loads((tmp_path / "rte" / "results.json").read_text())
    assert res["attention"] == "mhe-mul" and math.isfinite(res["score"])


def _hf_gpt2_dir(path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                  eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    cfg = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.save_pretrained(path)
    hf_tok.save_pretrained(path)
    return model.eval()


def test_a_hugging_face_gpt2_directory_converts_with_its_tokenizer(tmp_path, capsys):
    hf = _hf_gpt2_dir(tmp_path / "hf")
    out = tmp_path / "mqa"
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "mqa", "--out", str(out),
                 "--no-eval", "--calibration", "0"]) == 0
    err = capsys.readouterr().err
    assert "<|endoftext|> is [EOS]" in err
    from mhe.data.tokenize import load_tokenizer

    tok = load_tokenizer(out)
    assert tok.token_to_id("[EOS]") == 0  # GPT-2's end of text keeps its id
    record = json.loads((out / "config.json").read_text())
    assert record["run"]["task"] == "lm" and record["model"]["attention"] == "mqa"
    # a decoder keeps its vocabulary and special tokens: no encoder's [CLS]/[SEP]/[MASK] (issue 45)
    assert record["model"]["vocab_size"] == tok.get_vocab_size() == hf.config.vocab_size
    assert all(tok.token_to_id(s) is None for s in ("[CLS]", "[SEP]", "[MASK]"))
    weights = model_weights(latest_checkpoint(out / "checkpoints"))
    assert torch.equal(weights["decoder.embed.tokens.weight"], hf.transformer.wte.weight.detach())
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(out), "--prompt", "the cat", "--max-new-tokens", "2"]) == 0


@pytest.mark.parametrize("args, match", [
    (["--attention", "linear"],
     "cannot convert to attention kind 'linear'; valid targets: mhe-mul, mhe-add, mqa, gqa, sha"),
    (["--attention", "gqa", "--n-kv-heads", "3"], "n_kv_heads=3 must be a positive divisor of n_heads=4"),
    (["--attention", "mqa", "--calibration", "-1"], "--calibration must be a number of sequences >= 0, got -1"),
    (["--attention", "mqa", "--device", "gpu"], "--device 'gpu' is not allowed; it takes auto, cpu, cuda or cuda:N"),
])
def test_bad_input_is_one_line_and_exit_2(mha_run, tmp_path, capsys, args, match):
    assert main(["convert", "--checkpoint", str(mha_run), "--out", str(tmp_path / "x"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err
    assert not (tmp_path / "x").exists()


def test_bad_sources_are_one_line_errors(mha_run, converted, tmp_path, capsys):
    other = tmp_path / "t5"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"],
                                                   "model_type": "t5"}))
    cases = [(str(tmp_path / "nowhere"), "does not exist"),
             (str(converted), "the source model's attention is 'mhe-mul', not multi-head"),
             (str(other), "T5ForConditionalGeneration")]
    for source, match in cases:
        assert main(["convert", "--checkpoint", source, "--attention", "mqa", "--out", str(tmp_path / "y"),
                     "--no-eval", "--calibration", "0"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and match in err, err
    full = tmp_path / "full"
    full.mkdir()
    (full / "file").write_text("x")
    assert main(["convert", "--checkpoint", str(mha_run), "--attention", "mqa", "--out", str(full)]) == 2
    assert "is not empty" in capsys.readouterr().err


@pytest.fixture(scope="module")
def mlm_run(tmp_path_factory):
    """A 4-step MHA encoder (masked LM) on 200 lines of PTB."""
    root = require_data("ptb/ptb.train.txt.gz", "ptb/ptb.valid.txt.gz", "ptb/ptb.test.txt.gz")
    out = tmp_path_factory.mktemp("runs") / "mlm"
    assert main(["pretrain", "--preset", "tiny-encoder", "--data", "ptb", "--data-dir", str(root),
                 "--out", str(out), *TINY, "--set", "data.vocab_size=300"]) == 0
    return out


def test_an_encoder_run_converts_and_its_task_score_is_reported(mlm_run, tmp_path, capsys):
    out = tmp_path / "mhe-add"
    assert main(["convert", "--checkpoint", str(mlm_run), "--attention", "mhe-add", "--out", str(out),
                 "--device", "cpu", "--calibration", "8"]) == 0
    assert "mlm_accuracy on the valid split" in capsys.readouterr().out
    scores = json.loads((out / "conversion.json").read_text())["scores"]
    assert scores["converted"]["metric"] == "mlm_accuracy" and 0 <= scores["converted"]["score"] <= 1
    assert main(["eval", "--task", "mlm", "--checkpoint", str(out)]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mlm_accuracy"] == pytest.approx(scores["converted"]["mlm_accuracy"], rel=1e-9)


def test_a_hugging_face_bert_directory_keeps_its_special_tokens(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from mhe.data.tokenize import load_tokenizer

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ran in the park"] * 10, trainers.WordPieceTrainer(
        vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]",
                                                  cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    cfg = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
    transformers.BertForMaskedLM(cfg).save_pretrained(tmp_path / "hf")
    hf_tok.save_pretrained(tmp_path / "hf")
    out = tmp_path / "sha"
    assert main(["convert", "--checkpoint", str(tmp_path / "hf"), "--attention", "sha", "--out", str(out),
                 "--no-eval", "--calibration", "0"]) == 0
    mine = load_tokenizer(out)
    assert all(mine.token_to_id(t) == tok.token_to_id(t) for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"))
    assert mine.token_to_id("[EOS]") == cfg.vocab_size + 1  # [BOS], [EOS] appended after the vocabulary
    record = json.loads((out / "config.json").read_text())
    assert record["run"]["task"] == "mlm" and record["model"]["arch"] == "encoder"
