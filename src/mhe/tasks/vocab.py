"""Which tokenizer a run trains when the configuration does not say (section 4.4).

The paper's conventions follow the architecture of the preset:

* encoder (BERT presets): a 30K WordPiece vocabulary (section 4.4, "Pre-training");
* decoder (GPT-2 presets): GPT-2's byte-level BPE, 50,257 entries (Radford et al. 2019);
* encoder-decoder (Transformer presets): a 37K BPE shared by source and target
  (section 4.4, "Fine-tuning and Training").

``tiny-*`` presets keep the task's small vocabulary, sized for a CPU. ``data.tokenizer``
and ``data.vocab_size`` override either part, and a word-level corpus (Penn Treebank)
keeps its words unless ``data.tokenizer`` says otherwise (decided in ``tasks/text.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mhe.errors import MheError
from mhe.models.config import cpu_sized, preset


@dataclass(frozen=True)
class TokenizerChoice:
    kind: str                        # bpe | wordpiece | word
    vocab_size: int


PAPER_TOKENIZERS = {
    "encoder": TokenizerChoice("wordpiece", 30_000),
    "decoder": TokenizerChoice("bpe", 50_257),
    "encoder-decoder": TokenizerChoice("bpe", 37_000),
}

# the tasks' small vocabularies, for tiny presets and presets of no known shape
TASK_TOKENIZERS = {
    "lm": TokenizerChoice("bpe", 8192),
    "mlm": TokenizerChoice("wordpiece", 8192),
    "mt": TokenizerChoice("bpe", 8000),
}
TINY_MT_VOCAB = {"wmt14": 37_000, "multi30k": 8000}  # tiny translation keeps its per-corpus size


def preset_tokenizer(preset_name: str, task: str, dataset: str = "") -> TokenizerChoice:
    """The tokenizer ``preset_name`` trains for ``task`` before any ``data.*`` override."""
    small = TASK_TOKENIZERS[task]
    if task == "mt":
        small = TokenizerChoice("bpe", TINY_MT_VOCAB.get(dataset, small.vocab_size))
    if cpu_sized(preset_name):
        return small
    try:
        arch = preset(preset_name).arch
    except MheError:
        return small
    return PAPER_TOKENIZERS.get(arch, small)


def resolve_tokenizer(cfg, task: str, *, word_level_corpus: bool = False) -> TokenizerChoice:
    """The preset's convention with ``data.tokenizer`` / ``data.vocab_size`` applied on top.

    A word-level corpus keeps its whole vocabulary (PTB: 10k) unless a size or another kind is given."""
    choice = preset_tokenizer(cfg.preset, task, cfg.data.dataset)
    kind = cfg.data.tokenizer or ("word" if word_level_corpus else choice.kind)
    default = 1_000_000 if kind == "word" else choice.vocab_size
    return TokenizerChoice(kind, cfg.data.vocab_size or default)
