"""Model configuration and the presets of the paper's tables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mhe.attention.registry import KINDS, accepts_option
from mhe.errors import MheError, one_of, require_positive

ARCHS = ("encoder", "decoder", "encoder-decoder")
HEADS = {"encoder": ("mlm", "classification", "qa"), "decoder": ("lm", "classification"),
         "encoder-decoder": ("seq2seq",)}


@dataclass
class ModelConfig:
    """Everything needed to build a model; a preset fills it, ``--set model.X=`` edits it.

    ``n_layers`` counts the layers of each stack (the encoder-decoder has
    ``n_layers`` encoder and ``n_layers`` decoder layers). ``attention`` is the
    kind used by every attention sublayer; ``attn_options`` are passed to it.
    """

    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_len: int
    head_dim: int | None = None
    attention: str = "mha"
    attn_options: dict = field(default_factory=dict)
    attn_bias: bool = False
    attn_kernel: str = "sdpa"  # how attention runs (mhe.attention.kernels.KERNELS); never changes results
    dropout: float = 0.1
    attn_dropout: float = 0.1
    norm_first: bool = False
    layer_norm_eps: float = 1e-5
    type_vocab_size: int = 0
    positions: str = "learned"
    tie_embeddings: bool = True
    pad_id: int = 0
    head: str = ""
    num_labels: int = 2
    adaptive_cutoffs: list = field(default_factory=list)  # decoder LM: adaptive softmax (Grave et al. 2017)

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise one_of("architecture", self.arch, ARCHS)
        if self.attention not in KINDS:
            raise one_of("attention kind", self.attention, KINDS)
        require_positive(vocab_size=self.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
                         n_heads=self.n_heads, d_ff=self.d_ff, max_len=self.max_len)
        if self.head_dim is None and self.d_model % self.n_heads:
            raise MheError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; set head_dim")
        if self.positions not in ("learned", "sinusoidal"):
            raise one_of("position embedding", self.positions, ("learned", "sinusoidal"))
        if not self.head:
            self.head = HEADS[self.arch][0]
        if self.head not in HEADS[self.arch]:
            raise one_of(f"head for a {self.arch}", self.head, HEADS[self.arch])
        require_positive(num_labels=self.num_labels)
        cuts = list(self.adaptive_cutoffs)
        if cuts and (cuts != sorted(set(cuts)) or cuts[0] <= 0 or cuts[-1] >= self.vocab_size):
            raise MheError(f"adaptive_cutoffs must increase strictly within 1..{self.vocab_size - 1}, got {cuts}")

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def attention_options(self, *, causal: bool) -> dict:
        """Keyword options for :func:`build_attention` for one sublayer of this model."""
        opts = {"dropout": self.attn_dropout, "bias": self.attn_bias, "causal": causal, "kernel": self.attn_kernel}
        if accepts_option(self.attention, "max_len"):
            opts["max_len"] = self.max_len
        opts.update(self.attn_options)
        return opts

    def replace(self, **changes) -> "ModelConfig":
        valid = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(changes) - valid)
        if bad:
            raise MheError(f"unknown model option {bad[0]!r}; valid: {', '.join(sorted(valid))}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _bert(**kw) -> ModelConfig:
    base = dict(arch="encoder", vocab_size=30522, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                max_len=512, norm_first=False, layer_norm_eps=1e-12, type_vocab_size=2)
    return ModelConfig(**{**base, **kw})


def _gpt2(**kw) -> ModelConfig:
    base = dict(arch="decoder", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                max_len=512, norm_first=True)
    return ModelConfig(**{**base, **kw})


def _transformer(**kw) -> ModelConfig:
    base = dict(arch="encoder-decoder", vocab_size=37000, d_model=512, n_layers=6, n_heads=8, d_ff=2048,
                max_len=100, norm_first=False, positions="sinusoidal", pad_id=0)
    return ModelConfig(**{**base, **kw})


PRESETS = {
    # section 4.3 / Table 1: BERT-base, 12 layers, 768 wide, 12 heads, max length 512
    "bert-base": lambda: _bert(),
    # Appendix D (Table 9, "large"): 24 layers, 16 heads
    "bert-large": lambda: _bert(d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
    # section 4.3 / Table 2: GPT-2 base, max length 512
    "gpt2-base": lambda: _gpt2(),
    # Appendix D (Table 9, "medium"): 24 layers, 1024 wide, 16 heads
    "gpt2-medium": lambda: _gpt2(d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
    # section 4.3 / Table 3: Transformer base, 6+6 layers, 512 wide, 8 heads, max length 100
    "transformer-base": lambda: _transformer(),
    # Appendix D, seq2seq scaling table (Table 10)
    "transformer-16x32": lambda: _transformer(n_heads=16, head_dim=32),
    "transformer-4x128": lambda: _transformer(n_heads=4, head_dim=128),
    "transformer-4l": lambda: _transformer(n_layers=4),
    "transformer-8l": lambda: _transformer(n_layers=8),
    "transformer-12h": lambda: _transformer(d_model=768, n_heads=12, d_ff=3072, dropout=0.15, attn_dropout=0.15),
    "transformer-big": lambda: _transformer(d_model=1024, n_heads=16, d_ff=4096, dropout=0.3, attn_dropout=0.3),
    # tiny models for tests and CPU runs (seconds to minutes)
    "tiny-encoder": lambda: _bert(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=128,
                                  dropout=0.1, attn_dropout=0.1),
    "tiny-decoder": lambda: _gpt2(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, d_ff=512, max_len=128,
                                  dropout=0.1, attn_dropout=0.1),
    "tiny-encoder-decoder": lambda: _transformer(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                                                 max_len=128),
}


def preset(name: str) -> ModelConfig:
    """The named preset's configuration (a fresh copy)."""
    if name not in PRESETS:
        raise one_of("preset", name, PRESETS)
    return PRESETS[name]()
