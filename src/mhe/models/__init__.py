"""The three architectures of the paper (section 4.3) and their presets.

Names are imported on first use (PEP 562): the configuration and presets
(:mod:`mhe.models.config`) come without torch, the models with it.
"""

import importlib

_WHERE = {
    "MODEL_CLASSES": "build", "build_model": "build", "require_model": "build", "resolve_config": "build",
    "ARCHS": "config", "PRESETS": "config", "ModelConfig": "config", "preset": "config",
    "DecoderForCausalLM": "decoder", "DecoderForSequenceClassification": "decoder",
    "EncoderForMaskedLM": "encoder", "EncoderForQuestionAnswering": "encoder",
    "EncoderForSequenceClassification": "encoder",
    "ModelOutput": "outputs", "EncoderDecoder": "seq2seq",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"mhe.models.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'mhe.models' has no attribute {name!r}")
