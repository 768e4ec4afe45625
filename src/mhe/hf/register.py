"""Register the configurations and models with transformers' Auto classes."""

from __future__ import annotations


def register() -> None:
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForMaskedLM,
        AutoModelForQuestionAnswering,
        AutoModelForSeq2SeqLM,
        AutoModelForSequenceClassification,
    )

    from mhe.hf import modeling as m
    from mhe.hf.configuration import MheDecoderConfig, MheEncoderConfig, MheSeq2SeqConfig

    for cfg in (MheEncoderConfig, MheDecoderConfig, MheSeq2SeqConfig):
        AutoConfig.register(cfg.model_type, cfg, exist_ok=True)
    pairs = [(AutoModelForMaskedLM, MheEncoderConfig, m.MheEncoderForMaskedLM),
             (AutoModelForSequenceClassification, MheEncoderConfig, m.MheEncoderForSequenceClassification),
             (AutoModelForQuestionAnswering, MheEncoderConfig, m.MheEncoderForQuestionAnswering),
             (AutoModelForCausalLM, MheDecoderConfig, m.MheDecoderForCausalLM),
             (AutoModelForSequenceClassification, MheDecoderConfig, m.MheDecoderForSequenceClassification),
             (AutoModelForSeq2SeqLM, MheSeq2SeqConfig, m.MheSeq2SeqLM)]
    for auto, cfg, model in pairs:
        auto.register(cfg, model, exist_ok=True)
