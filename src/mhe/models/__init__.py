"""The three architectures of the paper (section 4.3) and their presets."""

from mhe.models.build import MODEL_CLASSES, build_model, require_model, resolve_config
from mhe.models.config import ARCHS, PRESETS, ModelConfig, preset
from mhe.models.decoder import DecoderForCausalLM, DecoderForSequenceClassification
from mhe.models.encoder import (
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
)
from mhe.models.outputs import ModelOutput
from mhe.models.seq2seq import EncoderDecoder

__all__ = ["ARCHS", "MODEL_CLASSES", "PRESETS", "DecoderForCausalLM", "DecoderForSequenceClassification",
           "EncoderDecoder", "EncoderForMaskedLM", "EncoderForQuestionAnswering",
           "EncoderForSequenceClassification", "ModelConfig", "ModelOutput", "build_model", "preset",
           "require_model", "resolve_config"]
