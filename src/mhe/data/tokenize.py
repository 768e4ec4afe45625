"""Tokenizers trained with the ``tokenizers`` library and saved as ``tokenizer.json``.

* ``bpe``: byte-level BPE (GPT-2 style) for the decoder; lossless.
* ``wordpiece``: BERT's WordPiece for the encoder (30K in the paper).
* ``word``: whitespace word level, the Penn Treebank convention.

Every tokenizer has the special tokens ``[PAD]`` (id 0), ``[UNK]``, ``[CLS]``,
``[SEP]``, ``[MASK]``, ``[BOS]`` and ``[EOS]``.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import tokenizers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from mhe.errors import MheError, one_of
from mhe.output_paths import shown_path
from mhe.progress import note

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[BOS]", "[EOS]"]
KINDS = ("bpe", "wordpiece", "word")
RECIPE = 1  # raise when train_tokenizer would train another tokenizer from the same lines: old cache entries miss


def train_tokenizer(kind: str, texts, vocab_size: int, *, lowercase: bool = False,
                    progress: bool = False) -> Tokenizer:
    """Train a tokenizer of ``kind`` on an iterable of strings; ``progress``: say so on standard
    error first (and show the ``tokenizers`` trainer's own bar where both standard streams are
    terminals: that bar writes to standard output, and blank lines there would come before a
    command's result when it is piped)."""
    if kind not in KINDS:
        raise one_of("tokenizer", kind, KINDS)
    if vocab_size < len(SPECIALS) + 1:
        raise MheError(f"vocab_size must be at least {len(SPECIALS) + 1}, got {vocab_size}")
    bar = progress and sys.stdout.isatty() and sys.stderr.isatty()
    note(f"training a {kind} tokenizer of at most {vocab_size:,} entries"
         + (f" on {len(texts):,} lines" if hasattr(texts, "__len__") else ""), enabled=progress)
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=bar)
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=bar)
    else:
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
        trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=bar)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_key(kind: str, texts: list[str], vocab_size: int, *, lowercase: bool = False) -> str:
    """SHA-256 of what :func:`train_tokenizer` learns from: every line (the corpus's checksum, as
    read: ``data.limit_lines`` included), the kind, the size, the recipe and the library's version."""
    h = hashlib.sha256(f"{RECIPE}|{tokenizers.__version__}|{kind}|{vocab_size}|{lowercase}|{len(texts)}\n".encode())
    for line in texts:
        h.update(line.encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return h.hexdigest()


def cached_tokenizer(kind: str, texts: list[str], vocab_size: int, *, cache: Path | None, lowercase: bool = False,
                     progress: bool = False) -> Tokenizer:
    """:func:`train_tokenizer`, or the tokenizer it trained before from the same lines and settings
    (:func:`tokenizer_key`), kept in ``cache/tokenizers`` (None: always train). Written atomically
    (a temporary name per process, then renamed): runs that train the same one at once each write a
    whole file. An unreadable entry is trained again; a cache that cannot be written is skipped."""
    if cache is None:
        return train_tokenizer(kind, texts, vocab_size, lowercase=lowercase, progress=progress)
    key = tokenizer_key(kind, texts, vocab_size, lowercase=lowercase)
    path = Path(cache) / "tokenizers" / f"{kind}-{vocab_size}-{key[:24]}.json"
    if path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception:  # noqa: BLE001  the library raises a bare Exception for a corrupt file: train again
            tok = None
        if tok is not None:
            note(f"reusing the {kind} tokenizer of at most {vocab_size:,} entries trained before on these "
                 f"{len(texts):,} lines ({shown_path(path)})", enabled=progress)
            return tok
    tok = train_tokenizer(kind, texts, vocab_size, lowercase=lowercase, progress=progress)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tok.save(str(tmp))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
    return tok


def with_pair_template(tok: Tokenizer) -> Tokenizer:
    """[CLS] A [SEP] (B [SEP]) with token types, as BERT's inputs are built."""
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tok


def save_tokenizer(tok: Tokenizer, directory: str | Path) -> Path:
    path = Path(directory) / "tokenizer.json"
    tmp = path.with_suffix(".json.tmp")
    tok.save(str(tmp))
    tmp.replace(path)
    return path


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise MheError(f"no tokenizer at {path}")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises a bare Exception for a corrupt file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise MheError(f"{path}: not a readable tokenizer ({reason})") from e


def special_id(tok: Tokenizer, name: str) -> int:
    i = tok.token_to_id(name)
    if i is None:
        raise MheError(f"tokenizer has no special token {name}")
    return i
