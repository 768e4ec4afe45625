"""``build_model``: one entry point for every architecture, head and attention kind."""

from __future__ import annotations

from torch import nn

from mhe.errors import MheError
from mhe.models.config import ModelConfig, preset
from mhe.models.decoder import DecoderForCausalLM, DecoderForSequenceClassification
from mhe.models.encoder import (
    EncoderForMaskedLM,
    EncoderForQuestionAnswering,
    EncoderForSequenceClassification,
)
from mhe.models.seq2seq import EncoderDecoder

MODEL_CLASSES = {
    ("encoder", "mlm"): EncoderForMaskedLM,
    ("encoder", "classification"): EncoderForSequenceClassification,
    ("encoder", "qa"): EncoderForQuestionAnswering,
    ("decoder", "lm"): DecoderForCausalLM,
    ("decoder", "classification"): DecoderForSequenceClassification,
    ("encoder-decoder", "seq2seq"): EncoderDecoder,
}


def require_model(model: object, what: str) -> None:
    """Refuse a ``model`` that is not one of :data:`MODEL_CLASSES` (``what``: the call, for the
    error), in one line naming its type, before anything reads ``model.cfg``."""
    if not isinstance(model, tuple(MODEL_CLASSES.values())) or not isinstance(getattr(model, "cfg", None), ModelConfig):
        raise MheError(f"{what} takes an mhe model ({', '.join(c.__name__ for c in MODEL_CLASSES.values())}), "
                       f"got {type(model).__name__}")


def resolve_config(preset_or_config: str | ModelConfig, *, attention: str | None = None,
                   **overrides) -> ModelConfig:
    if not isinstance(preset_or_config, (str, ModelConfig)):
        raise MheError(f"build_model takes a preset name or a ModelConfig, got {type(preset_or_config).__name__}")
    cfg = preset(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    if attention is not None:
        overrides["attention"] = attention
    return cfg.replace(**overrides) if overrides else cfg.replace()


def build_model(preset_or_config: str | ModelConfig, *, attention: str | None = None, **overrides) -> nn.Module:
    """Build a model from a preset name or a :class:`ModelConfig`.

    Args:
        preset_or_config: e.g. ``"bert-base"``, ``"gpt2-base"``, ``"transformer-base"``,
            ``"tiny-decoder"``; or a config.
        attention: the attention kind of every sublayer (default: the config's).
        **overrides: any :class:`ModelConfig` field, e.g. ``head="classification"``,
            ``num_labels=3``, ``vocab_size=8000``.
    """
    cfg = resolve_config(preset_or_config, attention=attention, **overrides)
    return MODEL_CLASSES[(cfg.arch, cfg.head)](cfg)
