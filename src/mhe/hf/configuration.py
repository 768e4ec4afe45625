"""``PreTrainedConfig`` subclasses: one ``model_type`` per architecture, holding a ModelConfig.

transformers 5.x configurations are dataclasses: fields are declared on the class and
derived values are filled in ``__post_init__``.
"""

from __future__ import annotations

import dataclasses

from transformers import PreTrainedConfig

from mhe.models.config import ModelConfig

_BASE = {"vocab_size": 1024, "d_model": 64, "n_layers": 2, "n_heads": 4, "d_ff": 256, "max_len": 128}


class _MheConfig(PreTrainedConfig):
    arch = ""
    mhe: dict | None = None  # the core ModelConfig as a dict
    use_cache: bool = True
    vocab_size: int = 1024
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    head_dim: int = 16
    max_position_embeddings: int = 128
    attention_kind: str = "mha"

    def __post_init__(self, **kwargs):
        self.mhe = {**_BASE, **(self.mhe or {}), "arch": self.arch}
        cfg = self._core()
        # the names Hugging Face utilities read
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.d_model
        self.num_hidden_layers = cfg.n_layers
        self.num_attention_heads = cfg.n_heads
        self.head_dim = cfg.resolved_head_dim
        self.max_position_embeddings = cfg.max_len
        self.attention_kind = cfg.attention
        if getattr(self, "pad_token_id", None) is None:
            self.pad_token_id = cfg.pad_id
        self.tie_word_embeddings = cfg.tie_embeddings
        super().__post_init__(**kwargs)

    def _core(self) -> ModelConfig:
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in self.mhe.items() if k in fields and k not in ("head", "num_labels")})

    def model_config(self, head: str) -> ModelConfig:
        """The core configuration with ``head`` and this config's number of labels."""
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        d = {k: v for k, v in self.mhe.items() if k in fields}
        d.update(head=head, num_labels=self.num_labels if head == "classification" else d.get("num_labels", 2))
        return ModelConfig(**d)

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "_MheConfig":
        extra = {"num_labels": cfg.num_labels} if cfg.head == "classification" else {}
        return cls(mhe=cfg.to_dict(), **{**extra, **kwargs})


class MheEncoderConfig(_MheConfig):
    model_type = "mhe-encoder"
    arch = "encoder"


class MheDecoderConfig(_MheConfig):
    model_type = "mhe-decoder"
    arch = "decoder"


class MheSeq2SeqConfig(_MheConfig):
    model_type = "mhe-encoder-decoder"
    arch = "encoder-decoder"
    is_encoder_decoder: bool = True
