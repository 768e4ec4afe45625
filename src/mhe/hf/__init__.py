"""Hugging Face ``transformers`` interoperability (optional: ``pip install mhe[hf]``).

``import mhe.hf`` registers the configurations and models with the Auto classes:

* ``mhe-encoder``: ``AutoModelForMaskedLM``, ``AutoModelForSequenceClassification``,
  ``AutoModelForQuestionAnswering``;
* ``mhe-decoder``: ``AutoModelForCausalLM`` (``generate()`` with the 5.x ``Cache`` API, one
  K/V head for MHE and MQA), ``AutoModelForSequenceClassification``;
* ``mhe-encoder-decoder``: ``AutoModelForSeq2SeqLM``.

The models wrap the core ``mhe.models`` modules (attribute ``mhe``); ``to_hf`` and ``from_hf``
convert in both directions without copying weights. Supported: transformers >= 5.0, < 6
(tested with 5.17 and 5.24).
"""

from mhe.hf.configuration import MheDecoderConfig, MheEncoderConfig, MheSeq2SeqConfig
from mhe.hf.convert import from_hf, to_hf, to_hf_tokenizer
from mhe.hf.modeling import (
    MheDecoderForCausalLM,
    MheDecoderForSequenceClassification,
    MheEncoderForMaskedLM,
    MheEncoderForQuestionAnswering,
    MheEncoderForSequenceClassification,
    MheSeq2SeqLM,
)
from mhe.hf.register import register

register()

__all__ = ["MheDecoderConfig", "MheDecoderForCausalLM", "MheDecoderForSequenceClassification", "MheEncoderConfig",
           "MheEncoderForMaskedLM", "MheEncoderForQuestionAnswering", "MheEncoderForSequenceClassification",
           "MheSeq2SeqConfig", "MheSeq2SeqLM", "from_hf", "register", "to_hf", "to_hf_tokenizer"]
