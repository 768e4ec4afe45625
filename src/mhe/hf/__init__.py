"""Hugging Face ``transformers`` interoperability (optional: ``pip install mhe[hf]``).

``import mhe.hf`` registers the configurations and models with the Auto classes:

* ``mhe-encoder``: ``AutoModelForMaskedLM``, ``AutoModelForSequenceClassification``,
  ``AutoModelForQuestionAnswering``;
* ``mhe-decoder``: ``AutoModelForCausalLM`` (``generate()`` with the 5.x ``Cache`` API, one
  K/V head for MHE and MQA), ``AutoModelForSequenceClassification``;
* ``mhe-encoder-decoder``: ``AutoModelForSeq2SeqLM``.

The models wrap the core ``mhe.models`` modules (attribute ``mhe``); ``to_hf`` and ``from_hf``
convert in both directions without copying weights, keeping them bit for bit. ``import_hf`` and
``export_hf`` (``mhe.hf.weights``) copy Hugging Face GPT-2, BERT and Llama-family weights (a model
object or a local ``save_pretrained`` directory) into ``mhe`` models and back, exactly.

Folders anyone can load (:mod:`mhe.hf.export`): ``save_model(model, out)`` writes a model with its
own modeling code (``trust_remote_code=True``, no mhe needed) or, with ``format="standard"``, as
Llama/Qwen2/Mistral, GPT-2, BERT or GPTBigCode where one holds it exactly. A run folder in one
call: ``from_run(run)`` (the model, its tokenizer attached: ``save_pretrained`` writes both) and
``export_run(run, out)`` (what ``mhe export`` writes). Those two read runs, so they live a layer
up (``mhe.tasks.hf_runs``) and are named here lazily.

LoRA (peft) on these models targets the ``nn.Linear`` layers the forward calls as modules:
``q_proj``, ``k_proj``, ``v_proj``, ``out_proj`` and the feed-forward's ``fc_in``/``fc_out`` or
``gate``/``up``/``down``; fast MHE reads its query and output weights folded with the head
embeddings, so its adapters go on ``k_proj``, ``v_proj`` and the feed-forward (the exported model,
``to_remote``, takes all of them). Merge before ``generate``: its decode step reads the weights.
Supported: transformers >= 5.0, < 6
(tested with 5.17 and 5.24).
"""

import importlib

from mhe.hf.configuration import MheDecoderConfig, MheEncoderConfig, MheSeq2SeqConfig
from mhe.hf.convert import from_hf, to_hf, to_hf_tokenizer
from mhe.hf.export import save_model, to_remote, to_standard, with_tokenizer
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
           "MheSeq2SeqConfig", "MheSeq2SeqLM", "export_hf", "export_run", "from_hf", "from_run", "import_hf", "register",
           "save_model", "to_hf", "to_hf_tokenizer", "to_remote", "to_standard", "with_tokenizer"]

RUN_READERS = ("from_run", "export_run")
"""Names served by ``mhe.tasks.hf_runs`` (it reads run folders, a layer above this package)."""


def __getattr__(name: str):
    if name in RUN_READERS:  # imported on first use only: the run readers sit above this package
        return getattr(importlib.import_module("mhe.tasks.hf_runs"), name)
    raise AttributeError(f"module 'mhe.hf' has no attribute {name!r}")
