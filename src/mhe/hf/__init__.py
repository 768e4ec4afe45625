"""Hugging Face ``transformers`` interoperability (optional: ``pip install mhe[hf]``).

``import mhe.hf`` registers the configurations and models with the Auto classes:

* ``mhe-encoder``: ``AutoModelForMaskedLM``, ``AutoModelForSequenceClassification``,
  ``AutoModelForQuestionAnswering``;
* ``mhe-decoder``: ``AutoModelForCausalLM`` (``generate()`` with the 5.x ``Cache`` API, one
  K/V head for MHE and MQA), ``AutoModelForSequenceClassification``;
* ``mhe-encoder-decoder``: ``AutoModelForSeq2SeqLM``.

The models wrap the core ``mhe.models`` modules (attribute ``mhe``); ``to_hf`` and ``from_hf``
convert in both directions without copying weights, keeping them bit for bit (a run folder in one
call: ``mhe.tasks.hf_runs.from_run``, a layer up since it reads runs). ``import_hf`` and ``export_hf``
(``mhe.hf.weights``) copy Hugging Face GPT-2 and BERT weights (a model object or a local
``save_pretrained`` directory) into ``mhe`` MHA models and back, exactly. Supported: transformers >= 5.0, < 6
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
from mhe.hf.weights import export_hf, import_hf

register()

__all__ = ["MheDecoderConfig", "MheDecoderForCausalLM", "MheDecoderForSequenceClassification", "MheEncoderConfig",
           "MheEncoderForMaskedLM", "MheEncoderForQuestionAnswering", "MheEncoderForSequenceClassification",
           "MheSeq2SeqConfig", "MheSeq2SeqLM", "export_hf", "from_hf", "import_hf", "register", "to_hf", "to_hf_tokenizer"]
