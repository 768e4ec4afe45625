"""Model configuration and the presets of the paper's tables."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from mhe.attention.options import AttentionConfig, rotary_width
from mhe.attention.spec import KINDS, AttentionSpec, attention_spec
from mhe.errors import MheError, one_of
from mhe.settings import check_fields, setting

ACTIVATIONS = ("gelu", "gelu_tanh", "relu")
HEADS = {"encoder": ("mlm", "classification", "qa"), "decoder": ("lm", "classification"),
         "encoder-decoder": ("seq2seq",)}
"""Architecture -> the heads it can carry (the first is its default); the (arch, head)
pairs :data:`mhe.models.build.MODEL_CLASSES` maps to classes."""

ARCHS: tuple[str, ...] = tuple(HEADS)
"""The three architectures: BERT-like encoder, GPT-2-like decoder, Transformer encoder-decoder."""

POSITIONS = ("learned", "sinusoidal", "rotary")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("plain", "swiglu", "none")


@dataclass
class ModelConfig:
    """Everything needed to build a model; a preset fills it, ``--set model.X=`` edits it.

    ``n_layers`` counts the layers of each stack (the encoder-decoder has
    ``n_layers`` encoder and ``n_layers`` decoder layers). ``attention`` is the
    kind used by every attention sublayer (the one place a run names it), held as its name, which
    is what ``config.json`` and a run's config hash hold; :attr:`spec` is the kind itself, which
    the code asks (never the name); ``attn_options`` are that kind's typed options, the dataclass
    its attention sublayers are built with (the spec's ``options``; a dict is converted).
    ``activation`` is the feed-forward (and BERT MLM-transform) non-linearity: ``gelu``
    (exact, erf-based: BERT), ``gelu_tanh`` (the tanh approximation: GPT-2) or ``relu``
    (Vaswani et al. 2017, section 3.3).

    The Llama-style decoder (the ``llama-*`` presets) is this decoder with ``norm="rmsnorm"``
    (:class:`~mhe.models.layers.RMSNorm`, epsilon ``layer_norm_eps``), ``mlp="swiglu"`` (gated,
    three ``m x d_ff`` matrices, no biases), ``positions="rotary"`` (RoPE with base
    ``rope_base`` over the first ``rope_fraction`` of each head; :mod:`mhe.attention.rotary`),
    no attention biases (``qkv_bias=True`` gives the query, key and value projections biases
    without the output projection, as Qwen2 has them), grouped K/V heads (``attention="gqa"``,
    ``attn_options.n_kv_heads``) and a tied or untied output head (``tie_embeddings``).

    ``mlp="none"`` leaves the feed-forward sublayer (and its normalisation) out of every block:
    attention-only layers, as Zoology's recall models have them (Arora et al. 2023: the state
    mixer is the identity), whose feed-forward slows the forming of a recall circuit several
    fold (``mhe.experiments.grid_presets``); ``d_ff`` is then unused.
    """

    arch: Literal[ARCHS]
    vocab_size: int = setting(gt=0)
    d_model: int = setting(gt=0)
    n_layers: int = setting(gt=0)
    n_heads: int = setting(gt=0)
    d_ff: int = setting(gt=0)
    max_len: int = setting(gt=0)
    head_dim: int | None = setting(None, gt=0)
    attention: Literal[KINDS] = "mha"
    attn_options: object = None
    attn_bias: bool = False
    activation: Literal[ACTIVATIONS] = "gelu"
    attn_kernel: str = "sdpa"  # how attention runs (mhe.attention.kernels.KERNELS); never changes results
    dropout: float = setting(0.1, ge=0, lt=1)
    attn_dropout: float = setting(0.1, ge=0, lt=1)
    norm_first: bool = False
    layer_norm_eps: float = setting(1e-5, gt=0)
    type_vocab_size: int = setting(0, ge=0)
    positions: Literal[POSITIONS] = "learned"
    rope_base: float = setting(10000.0, gt=1)
    rope_fraction: float = setting(1.0, gt=0, le=1)
    norm: Literal[NORMS] = "layernorm"
    mlp: Literal[MLPS] = "plain"
    qkv_bias: bool = False
    tie_embeddings: bool = True
    pad_id: int = setting(0, ge=0)
    head: str = ""
    num_labels: int = setting(2, gt=0)
    adaptive_cutoffs: list[int] = field(default_factory=list)  # decoder LM: adaptive softmax (Grave et al. 2017)

    def __post_init__(self) -> None:
        # the kind is parsed here, once (a spec given in code is taken as it is); the config keeps
        # the spec beside the name config.json holds (an attribute, not a field: no dict or hash has it)
        spec = self.attention if isinstance(self.attention, AttentionSpec) else None
        if spec is None and self.attention in KINDS:
            spec = attention_spec(self.attention)
        if spec is not None:
            self.attention, self._spec = spec.name, spec
            self.attn_options = spec.make_options(self.attn_options)
        check_fields(self, "model")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise MheError(f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads} "
                           "(or set model.head_dim)")
        if not self.head:
            self.head = HEADS[self.arch][0]
        if self.head not in HEADS[self.arch]:
            raise one_of(f"head for a {self.arch}", self.head, HEADS[self.arch])
        n_kv = getattr(self.attn_options, "n_kv_heads", 1)  # 0: the default group count
        if n_kv and self.n_heads % n_kv:
            raise MheError(f"model.attn_options.n_kv_heads={n_kv} must divide model.n_heads={self.n_heads}")
        if self.positions == "rotary":
            self._check_rotary()
        cuts = list(self.adaptive_cutoffs)
        if cuts and (cuts != sorted(set(cuts)) or cuts[0] <= 0 or cuts[-1] >= self.vocab_size):
            raise MheError(f"model.adaptive_cutoffs must increase strictly within 1..{self.vocab_size - 1}, "
                           f"got {cuts}")

    def _check_rotary(self) -> None:
        if self.arch != "decoder":
            raise MheError(f"model.positions='rotary' is for the decoder; a {self.arch} takes learned or "
                           "sinusoidal positions")
        if self.spec.mixes:
            raise MheError(f"model.positions='rotary' must rotate queries and keys, which attention kind "
                           f"{self.attention!r} does not have (it mixes whole sequences); use a kind with a KV cache")
        rotary_width(self.resolved_head_dim, self.rope_fraction)

    @property
    def spec(self) -> AttentionSpec:
        """The attention kind's spec (:data:`mhe.attention.spec.SPECS`), parsed when the config was
        made; looked up again only where ``attention`` was since set in place (``--set``)."""
        spec = self.__dict__.get("_spec")
        if spec is None or spec.name != self.attention:
            spec = self._spec = attention_spec(self.attention)
        return spec

    @property
    def rotary(self) -> bool:
        """Rotary positions (RoPE) in every self-attention sublayer."""
        return self.positions == "rotary"

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    def attention_config(self, *, causal: bool) -> AttentionConfig:
        """The typed configuration of one attention sublayer of this model: the shared settings
        (``attn_dropout``, ``attn_bias``, ``qkv_bias``, ``attn_kernel``) and the kind's options
        dataclass ``attn_options`` itself (linear's unset ``max_len``: the model's)."""
        own = self.attn_options
        if any(f.name == "max_len" for f in dataclasses.fields(own)) and own.max_len is None:
            own = dataclasses.replace(own, max_len=self.max_len)
        return AttentionConfig(d_model=self.d_model, n_heads=self.n_heads, head_dim=self.head_dim,
                               dropout=self.attn_dropout, causal=causal, bias=self.attn_bias, qkv_bias=self.qkv_bias,
                               kernel=self.attn_kernel, options=own)

    def replace(self, **changes) -> "ModelConfig":
        valid = {f.name for f in dataclasses.fields(self)}
        bad = sorted(set(changes) - valid)
        if bad:
            raise MheError(f"unknown model setting {bad[0]!r}; valid keys: {', '.join(sorted(valid))}")
        kind = changes.get("attention", self.spec)  # the spec goes on: the name is not parsed again
        spec = kind if isinstance(kind, AttentionSpec) else attention_spec(kind) if kind in KINDS else None
        if spec is not None:
            changes["attention"] = spec
            if "attn_options" not in changes and spec.options is not type(self.attn_options):
                changes["attn_options"] = None  # a new kind starts from its own default options
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# The presets build the original architectures (biases, activation, LayerNorm epsilon); the
# initialisation of each family is in mhe.models.blocks. The paper's parameter counts leave the
# biases out (section 5.3, Table 4); mhe.accounting follows the paper unless asked for biases.


def _bert(**kw) -> ModelConfig:
    # Devlin et al. 2019 / google-research/bert modeling.py: Q/K/V/O biases, exact (erf) GELU,
    # LayerNorm epsilon 1e-12
    base = dict(arch="encoder", vocab_size=30522, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                max_len=512, norm_first=False, layer_norm_eps=1e-12, type_vocab_size=2, attn_bias=True,
                activation="gelu")
    return ModelConfig(**{**base, **kw})


def _gpt2(**kw) -> ModelConfig:
    # Radford et al. 2019 / openai gpt-2 model.py: biased c_attn and c_proj, tanh-approximated
    # GELU, LayerNorm epsilon 1e-5
    base = dict(arch="decoder", vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072,
                max_len=512, norm_first=True, layer_norm_eps=1e-5, attn_bias=True, activation="gelu_tanh")
    return ModelConfig(**{**base, **kw})


def _transformer(**kw) -> ModelConfig:
    # Vaswani et al. 2017: ReLU feed-forward (Eq. 2, with biases); attention projections without
    # biases (Eqs. 1 and section 3.2.2: MultiHead = Concat(head_i) W^O, head_i = Attention(Q W_i^Q, ...);
    # likewise the authors' tensor2tensor code); LayerNorm epsilon 1e-6 (tensor2tensor)
    base = dict(arch="encoder-decoder", vocab_size=37000, d_model=512, n_layers=6, n_heads=8, d_ff=2048,
                max_len=100, norm_first=False, positions="sinusoidal", pad_id=0, layer_norm_eps=1e-6,
                attn_bias=False, activation="relu")
    return ModelConfig(**{**base, **kw})


def _llama(**kw) -> ModelConfig:
    # Touvron et al. 2023 (LLaMA), section 2.2: pre-normalisation with RMSNorm, SwiGLU, rotary
    # embeddings, no biases; grouped K/V heads (Ainslie et al. 2023). No dropout, as released.
    base = dict(arch="decoder", vocab_size=32000, d_model=2048, n_layers=22, n_heads=32, d_ff=5632, max_len=2048,
                norm_first=True, norm="rmsnorm", mlp="swiglu", positions="rotary", rope_base=10000.0,
                layer_norm_eps=1e-5, attn_bias=False, dropout=0.0, attn_dropout=0.0, tie_embeddings=False,
                attention="gqa", attn_options={"n_kv_heads": 4})
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
    # Llama-style decoders (RMSNorm, SwiGLU, RoPE, grouped K/V), sized as public small models:
    # SmolLM-135M's config.json (HuggingFaceTB/SmolLM-135M: 134,515,008 parameters, tied head)
    "llama-135m": lambda: _llama(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, d_ff=1536,
                                 tie_embeddings=True, attn_options={"n_kv_heads": 3}),
    # TinyLlama-1.1B's config.json (TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T:
    # 1,100,048,384 parameters, untied head)
    "llama-1.1b": lambda: _llama(),
    # tiny models for tests and CPU runs (seconds to minutes)
    "tiny-encoder": lambda: _bert(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_len=128,
                                  dropout=0.1, attn_dropout=0.1),
    "tiny-decoder": lambda: _gpt2(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, d_ff=512, max_len=128,
                                  dropout=0.1, attn_dropout=0.1),
    "llama-tiny": lambda: _llama(vocab_size=1024, d_model=128, n_layers=2, n_heads=4, d_ff=352, max_len=128,
                                 tie_embeddings=True, attn_options={"n_kv_heads": 2}),
    "tiny-encoder-decoder": lambda: _transformer(vocab_size=1024, d_model=64, n_layers=2, n_heads=4, d_ff=256,
                                                 max_len=128),
}


def cpu_sized(name: str) -> bool:
    """Whether ``name`` is one of the presets sized for a CPU (``tiny-*``, ``llama-tiny``), which the
    tasks give short schedules and small vocabularies."""
    return name.startswith("tiny-") or name.endswith("-tiny")


def family_preset(cfg: ModelConfig) -> str:
    """The full-sized preset of ``cfg``'s family (``gpt2-base``, ``bert-base`` or, for a
    Llama-style decoder with rotary positions, ``llama-135m``): the one whose conventions (default
    schedule, tokenizer kind) a model of no preset takes, e.g. a converted Hugging Face checkpoint,
    whose run records no preset since its sizes are its own."""
    return next(name for name, make in PRESETS.items() if not cpu_sized(name) and make().arch == cfg.arch
                and (make().positions == "rotary") == (cfg.positions == "rotary"))


def preset(name: str) -> ModelConfig:
    """The named preset's configuration (a fresh copy)."""
    if name not in PRESETS:
        raise one_of("preset", name, PRESETS)
    return PRESETS[name]()

