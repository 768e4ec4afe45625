"""Core model <-> Hugging Face model, and tokenizers as ``PreTrainedTokenizerFast``."""

from __future__ import annotations

from mhe import models as core
from mhe.errors import MheError


def _hf_class(arch: str, head: str):
    """The Hugging Face wrapper of the core class that (arch, head) builds
    (:data:`mhe.models.MODEL_CLASSES`, the one (arch, head) map)."""
    from mhe.hf import modeling as m

    wrappers = {core.EncoderForMaskedLM: m.MheEncoderForMaskedLM,
                core.EncoderForSequenceClassification: m.MheEncoderForSequenceClassification,
                core.EncoderForQuestionAnswering: m.MheEncoderForQuestionAnswering,
                core.DecoderForCausalLM: m.MheDecoderForCausalLM,
                core.DecoderForSequenceClassification: m.MheDecoderForSequenceClassification,
                core.EncoderDecoder: m.MheSeq2SeqLM}
    cls = core.MODEL_CLASSES.get((arch, head))
    if cls not in wrappers:
        raise MheError(f"no Hugging Face class for a {arch} with head {head!r}")
    return wrappers[cls]


def to_hf(model, **config_kwargs):
    """Wrap a core model (no copy: the Hugging Face model holds the same module as ``.mhe``).

    Keeps the weights bit for bit: no initialisation runs over the module it is handed.
    ``config_kwargs`` go to the configuration (e.g. ``bos_token_id``, ``eos_token_id``).
    """
    core.require_model(model, "to_hf")
    cls = _hf_class(model.cfg.arch, model.cfg.head)
    config = cls.config_class.from_model_config(model.cfg, **config_kwargs)
    return cls(config, core=model)


def from_hf(hf_model):
    """The core model inside a Hugging Face model: the same module (no copy), so its weights
    bit for bit."""
    if not hasattr(hf_model, "mhe"):
        raise MheError(f"{type(hf_model).__name__} is not an mhe model")
    return hf_model.mhe


SPECIAL_ROLES = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                 "mask_token": "[MASK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}
"""transformers' special-token roles -> our special tokens (:data:`mhe.data.tokenize.SPECIALS`)."""


def to_hf_tokenizer(tok):
    """A ``PreTrainedTokenizerFast`` around a ``tokenizers`` tokenizer with our special tokens
    (those the tokenizer has: none is added, so the vocabulary keeps its size)."""
    from transformers import PreTrainedTokenizerFast

    roles = {role: token for role, token in SPECIAL_ROLES.items() if tok.token_to_id(token) is not None}
    return PreTrainedTokenizerFast(tokenizer_object=tok, **roles)
