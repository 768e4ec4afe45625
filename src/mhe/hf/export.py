"""A core model as a folder anyone with transformers can load: with its own modeling code
(``remote-code``) or as a standard transformers architecture where one holds it exactly.

``remote-code`` (any architecture and attention kind): the folder holds ``config.json`` (an
``auto_map`` naming the Auto classes), ``model.safetensors`` (mhe's own state dict, bit for
bit), ``configuration_mhe.py``, ``layers_mhe.py``, ``decode_mhe.py`` and ``modeling_mhe.py`` (copied from :mod:`mhe.hf.remote`; they
import only torch and transformers) and the tokenizer when given, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

works in a Python without mhe (``AutoModelForMaskedLM`` / ``AutoModelForSequenceClassification``
for encoders, ``AutoModelForSeq2SeqLM`` for translation).

``standard``: ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ``MistralForCausalLM`` for mha, gqa
and mqa Llama-style decoders, ``GPT2LMHeadModel`` / ``BertFor*`` for GPT-2- and BERT-shaped MHA
models (:func:`mhe.hf.weights.export_hf`), ``GPTBigCodeForCausalLM`` for GPT-2-style mqa and
fast MHE decoders (:mod:`mhe.hf.bigcode`); anything else (MHE under rotary positions, SKV,
EL-attention, ...) is refused in one line that names ``--format remote-code``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mhe.errors import MheError, one_of
from mhe.models import ModelConfig

FORMATS = ("remote-code", "standard")
REMOTE_DIR = Path(__file__).with_name("remote")
REMOTE_FILES = ("configuration_mhe.py", "layers_mhe.py", "decode_mhe.py", "modeling_mhe.py")
AUTO_CLASSES = {
    ("decoder", "lm"): {"AutoModelForCausalLM": "MheForCausalLM",
                        "AutoModelForSequenceClassification": "MheDecoderForSequenceClassification"},
    ("decoder", "classification"): {"AutoModelForSequenceClassification": "MheDecoderForSequenceClassification"},
    ("encoder", "mlm"): {"AutoModelForMaskedLM": "MheForMaskedLM",
                         "AutoModelForSequenceClassification": "MheForSequenceClassification",
                         "AutoModelForQuestionAnswering": "MheForQuestionAnswering"},
    ("encoder", "classification"): {"AutoModelForSequenceClassification": "MheForSequenceClassification"},
    ("encoder", "qa"): {"AutoModelForQuestionAnswering": "MheForQuestionAnswering"},
    ("encoder-decoder", "seq2seq"): {"AutoModelForSeq2SeqLM": "MheForSeq2SeqLM"},
}
"""(architecture, head) -> the Auto classes an exported folder answers (a pre-trained model also
as the start of fine-tuning: its classification or QA head then starts untrained)."""


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse, in one line, the models no exported form holds: attention-only blocks."""
    if cfg.mlp == "none":
        raise MheError("a model without feed-forward sublayers (model.mlp='none') has no exported form; "
                       "export models with model.mlp plain or swiglu")


def remote_config(cfg: ModelConfig, **config_kwargs):
    """The standalone ``MheConfig`` of ``cfg`` (``config_kwargs``: e.g. ``eos_token_id``)."""
    from mhe.hf.remote.configuration_mhe import MheConfig

    check_exportable(cfg)
    if cfg.adaptive_cutoffs:
        raise MheError("a model with an adaptive softmax (model.adaptive_cutoffs) has no exported form; "
                       "export models with a linear output layer")
    extra = {"num_labels": cfg.num_labels} if cfg.head == "classification" else {}
    return MheConfig(mhe=cfg.to_dict(), **{**extra, **config_kwargs})


def to_remote(model, **config_kwargs):
    """The standalone transformers model (:mod:`mhe.hf.remote.modeling_mhe`) equal to a core
    model: the same parameter names, every weight copied bit for bit (a strict load), in the
    model's dtype and mode."""
    from mhe.hf.remote.modeling_mhe import CLASSES

    cfg = model.cfg
    config = remote_config(cfg, **config_kwargs)
    cls = CLASSES[(cfg.arch, cfg.head)]
    config.architectures = [cls.__name__]
    config.auto_map = {"AutoConfig": "configuration_mhe.MheConfig",
                       **{auto: f"modeling_mhe.{name}" for auto, name in AUTO_CLASSES[(cfg.arch, cfg.head)].items()}}
    hf = cls(config).to(next(model.parameters()).dtype)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.train(model.training)


def to_standard(model, family: str | None = None):
    """The transformers model of a standard architecture equal to ``model`` (see the module
    docstring), or one line naming ``--format remote-code`` where none holds it."""
    from mhe.hf.bigcode import BIGCODE_KINDS, export_bigcode
    from mhe.hf.weights import export_hf

    cfg = model.cfg
    check_exportable(cfg)
    if family is not None and cfg.positions != "rotary":
        raise MheError(f"--family {family} chooses among Llama-style classes (rotary positions); this {cfg.arch} "
                       f"({cfg.positions} positions) exports as GPT-2/BERT/GPTBigCode: drop --family")
    try:
        if cfg.positions != "rotary" and cfg.arch == "decoder" and cfg.attention in BIGCODE_KINDS:
            return export_bigcode(model)
        return export_hf(model, family)
    except MheError as e:
        raise MheError(f"no standard transformers architecture holds this {cfg.arch} ({cfg.attention} attention, "
                       f"{cfg.positions} positions): {e}; use --format remote-code") from None


def hf_tokenizer(tokenizer):
    """A ``PreTrainedTokenizerFast`` (given as one, or made from a ``tokenizers.Tokenizer``)."""
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    from mhe.hf.convert import to_hf_tokenizer

    return to_hf_tokenizer(tokenizer)


def partial_path(out: Path) -> Path:
    """The temporary sibling :func:`save_model` writes ``out`` in before renaming it into place."""
    return out.with_name(f".{out.name}.partial-{os.getpid()}")


def save_model(model, out: str | Path, *, format: str = "remote-code", tokenizer=None, card: str | None = None,
               family: str | None = None, **config_kwargs) -> Path:
    """Write ``model`` (a core model) to the new folder ``out`` in ``format`` (``remote-code`` or
    ``standard``), with ``tokenizer`` (``tokenizers.Tokenizer`` or ``PreTrainedTokenizerFast``)
    and the model card ``card`` (``README.md``) when given. The folder appears whole or not at
    all (written beside it, then renamed); a place that cannot be written is refused before the
    model is converted (its temporary sibling is created and removed), and a write that fails
    later is one line (``MheError``), nothing left behind. Returns ``out``."""
    from mhe.output_paths import check_output_dir

    if format not in FORMATS:
        raise one_of("export format", format, FORMATS)
    if family is not None and format != "standard":
        raise MheError(f"--family {family} applies to --format standard (the transformers class written); "
                       f"--format {format} writes mhe's own classes: drop --family")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise MheError(f"--out {out} already exists and is not an empty folder; choose a new folder")
    tmp = partial_path(out)
    shutil.rmtree(tmp, ignore_errors=True)
    check_output_dir(out, "--out", temp=tmp.name)
    hf = to_remote(model, **config_kwargs) if format == "remote-code" else to_standard(model, family)
    for key, value in config_kwargs.items():
        setattr(hf.config, key, value)
    try:
        _write(hf, tmp, format, tokenizer, card)
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except OSError as e:
        raise MheError(f"--out {out}: the export could not be written ({e.strerror or e}); nothing was left "
                       "there") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write(hf, tmp: Path, format: str, tokenizer, card: str | None) -> None:
    """The export's files, in the temporary folder ``tmp``."""
    hf.save_pretrained(tmp)
    if format == "remote-code":
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE_DIR / name, tmp / name)
    fast = hf_tokenizer(tokenizer)
    if fast is not None:
        fast.save_pretrained(tmp)
    if card is not None:
        (tmp / "README.md").write_text(card)


def with_tokenizer(hf_model, tokenizer):
    """``hf_model`` whose ``save_pretrained(folder)`` also writes ``tokenizer`` there (so that
    ``AutoTokenizer`` loads the folder as ``AutoModel*`` does), with the tokenizer's ``[BOS]``,
    ``[EOS]`` and ``[PAD]`` ids in its config where it has them and the config has none.
    The tokenizer is also kept as ``hf_model.tokenizer``."""
    fast = hf_tokenizer(tokenizer)
    save = hf_model.save_pretrained

    def save_pretrained(save_directory, *args, **kwargs):
        result = save(save_directory, *args, **kwargs)
        fast.save_pretrained(save_directory)
        return result

    for field, token in (("bos_token_id", "[BOS]"), ("eos_token_id", "[EOS]"), ("pad_token_id", "[PAD]")):
        tid = fast.convert_tokens_to_ids(token) if token in fast.get_vocab() else None
        if tid is not None and getattr(hf_model.config, field, None) is None:
            setattr(hf_model.config, field, tid)
    hf_model.save_pretrained = save_pretrained
    hf_model.tokenizer = fast
    return hf_model
