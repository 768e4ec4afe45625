"""Where a conversion starts: a run folder, or a Hugging Face checkpoint directory (what
:func:`mhe.hf.import_hf` reads), as one :class:`Source` with its model, run configuration and
tokenizer; :func:`data_task` sets the source's task up on its data (scores, calibration).

A Hugging Face tokenizer (the directory's own, or ``tokenizer=`` another folder or a run's)
becomes one with the special tokens ``mhe`` runs use (``[PAD]``, ``[UNK]``, ``[CLS]``, ``[SEP]``,
``[MASK]``, ``[BOS]``, ``[EOS]``): a special token with one of those roles is renamed (GPT-2's
``<|endoftext|>`` becomes ``[EOS]``, keeping its id). An encoder's roles without a token of their
own get new ids after the model's vocabulary, with embedding rows (and output rows, bias entries)
equal to the mean of the existing ones; a decoder keeps its own special tokens and vocabulary
size (only a missing end token, which language-model data needs, is added). Without any
tokenizer the converted run holds ids only: placeholders for the model's vocabulary, its
``config.json``'s BOS/EOS/PAD ids named as such.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from mhe.data.tokenize import SPECIALS, load_tokenizer, save_tokenizer
from mhe.errors import MheError
from mhe.models import build_model
from mhe.models.config import family_preset
from mhe.tasks import build_task, default_run
from mhe.tasks.runs import load_run
from mhe.training.checkpoint import latest_checkpoint
from mhe.training.config import RunConfig
from mhe.training.distributed import Dist
from mhe.training.run_files import is_run_dir, read_json
from mhe.training.weights import has_best

PRETRAINING_TASKS = {"lm": "lm", "mlm": "mlm"}  # model head -> the task of a pre-training run
HF_ROLES = {"[EOS]": "eos_token", "[PAD]": "pad_token", "[SEP]": "sep_token", "[CLS]": "cls_token",
            "[MASK]": "mask_token", "[UNK]": "unk_token", "[BOS]": "bos_token"}  # in the order roles are given


@dataclass
class Source:
    """A model to convert: ``model`` (CPU, eval mode), ``cfg`` (the run configuration the
    converted folder starts from), ``tokenizer``, ``path``, ``origin`` (``run`` or
    ``huggingface``) and ``notes`` (what was changed on the way in)."""

    model: nn.Module
    cfg: RunConfig
    tokenizer: Tokenizer
    path: Path
    origin: str
    notes: list[str] = field(default_factory=list)
    text: bool = True  # False: a tokenizer of ids only (a Hugging Face directory without one)


def load_source(path: str | Path, *, data: str = "", data_dir: str = "", tokenizer: str = "") -> Source:
    """The run folder or Hugging Face directory at ``path``; ``data``/``data_dir``: the corpus
    and data folder the converted run records (default: the source run's); ``tokenizer``: for a
    Hugging Face directory, a folder or run whose tokenizer it uses (default: its own, if any)."""
    path = Path(path)
    if not path.exists():
        raise MheError(f"{path} does not exist: pass a run folder (with config.json) or a Hugging Face "
                       "checkpoint directory")
    if _is_run(path):
        if tokenizer:
            raise MheError(f"--tokenizer {tokenizer} is for a Hugging Face directory; the run {path} converts with "
                           "its own tokenizer")
        return _run_source(path, data, data_dir)
    if (path / "config.json").is_file():
        return _hf_source(path, data, data_dir, tokenizer)
    raise MheError(f"{path} is neither a run folder nor a Hugging Face checkpoint directory (no config.json)")


def _is_run(path: Path) -> bool:
    """A run folder (its config.json records a run), not a Hugging Face directory."""
    record = read_json(path / "config.json") if is_run_dir(path) else None
    return isinstance(record, dict) and "run" in record


def _run_source(path: Path, data: str, data_dir: str) -> Source:
    if not (path / "tokenizer.json").is_file():
        raise MheError(f"{path} has no tokenizer.json; a conversion keeps the run's tokenizer")
    if latest_checkpoint(path / "checkpoints", report=lambda _: None) is None and not has_best(path):
        raise MheError(f"{path} holds no complete checkpoint to convert")
    model, cfg, _ = load_run(path, inference=True)  # the weights; no corpus is read here
    cfg = copy.deepcopy(cfg)
    cfg.train.init_from = ""  # the converted run starts from its own weights
    if data:
        cfg.data.dataset = data
    if data_dir:
        cfg.data.data_dir = data_dir
    return Source(model.cpu().eval(), cfg, load_tokenizer(path), path, "run")


def _hf_source(path: Path, data: str, data_dir: str, tokenizer: str) -> Source:
    from mhe.hf.weights import import_hf

    tok_dir = Path(tokenizer) if tokenizer else path
    if tokenizer and not tok_dir.is_dir():
        raise MheError(f"--tokenizer {tokenizer} is not a folder; give a Hugging Face tokenizer folder or a run folder")
    text = bool(tokenizer) or has_tokenizer(path)
    if data and not text:
        raise MheError(f"--data {data} is text, and {path} has no tokenizer: pass --tokenizer DIR (a Hugging Face "
                       "tokenizer folder or a run folder)")
    model = import_hf(path).eval()
    head = model.cfg.head
    if head not in PRETRAINING_TASKS:
        raise MheError(f"{path} holds a {model.cfg.arch} with a {head!r} head; convert its pre-training "
                       f"checkpoint (heads: {', '.join(PRETRAINING_TASKS)}) and fine-tune the converted run")
    if text:
        tok, notes = hf_tokenizer(tok_dir, model.cfg.vocab_size, causal=model.cfg.arch == "decoder")
    else:
        tok, notes = ids_only_tokenizer(path, model.cfg.vocab_size)
    if tok.get_vocab_size() > model.cfg.vocab_size:
        model = grow_vocab(model, tok.get_vocab_size())
    task = PRETRAINING_TASKS[head]
    run = default_run(task, family_preset(model.cfg), "mha", data)  # the family's conventions
    run.data.data_dir = data_dir
    # no preset: the checkpoint's sizes are its own (config.json's model), not a preset's
    cfg = RunConfig(task=task, preset="", model=model.cfg.replace(), train=run.train, data=run.data)
    return Source(model, cfg, tok, path, "huggingface", notes, text)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


def has_tokenizer(path: Path) -> bool:
    """Whether the directory holds any tokenizer file transformers reads."""
    return any((path / name).is_file() for name in TOKENIZER_FILES)


def ids_only_tokenizer(path: Path, vocab_size: int) -> tuple[Tokenizer, list[str]]:
    """For a directory with no tokenizer: ``vocab_size`` placeholder tokens (the model's
    vocabulary, unchanged), the ids its ``config.json`` gives BOS, EOS and PAD named ``[BOS]``,
    ``[EOS]``, ``[PAD]``: the converted run works on ids; text needs the checkpoint's tokenizer."""
    from tokenizers import models

    config = read_json(path / "config.json") or {}
    names = {}
    for ours, key in (("[BOS]", "bos_token_id"), ("[EOS]", "eos_token_id"), ("[PAD]", "pad_token_id")):
        i = config.get(key)
        i = i[0] if isinstance(i, list) and i else i
        if isinstance(i, int) and 0 <= i < vocab_size and i not in names:
            names[i] = ours
    vocab = {names.get(i, f"[unused-{i}]"): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=names.get(0, "[unused-0]")))
    tok.add_special_tokens(list(names.values()))
    named = ", ".join(f"{v} = {k}" for k, v in sorted(names.items())) or "no special ids in config.json"
    return tok, [f"tokenizer: none in {path} (pass --tokenizer DIR, a folder or a run, to convert text); the "
                 f"converted run holds ids only: the model's vocabulary of {vocab_size:,} ({named})"]


def hf_tokenizer(path: Path, vocab_size: int, *, causal: bool = False) -> tuple[Tokenizer, list[str]]:
    """The folder's tokenizer (a run's ``tokenizer.json``, or one transformers reads) with ``mhe``'s
    special tokens (module docstring; ``causal``: a decoder's, nothing but a missing [EOS] added)
    and at least ``vocab_size`` entries (placeholders fill a model vocabulary larger than the tokenizer)."""
    if _is_run(path):
        return _fill(load_tokenizer(path), path, vocab_size, causal, [f"tokenizer: the run {path}'s"])
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds for a missing or broken tokenizer
        raise MheError(f"{path}: no tokenizer that transformers can read ({type(e).__name__}); a conversion "
                       "needs the checkpoint's tokenizer files") from e
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise MheError(f"{path}: the tokenizer is not a fast (tokenizers) one; save it with a tokenizer.json")
    spec = json.loads(backend.to_str())
    present = set(backend.get_vocab(with_added_tokens=True))
    renamed, notes = {}, []
    for ours, role in HF_ROLES.items():
        theirs = getattr(hf, role, None)
        if ours in present or not theirs or theirs in renamed or theirs not in present:
            continue
        renamed[theirs] = ours
        notes.append(f"tokenizer: {theirs} is {ours}")
    tok = Tokenizer.from_str(json.dumps(_rename(spec, renamed)))
    return _fill(tok, path, vocab_size, causal, notes)


def _fill(tok: Tokenizer, path: Path, vocab_size: int, causal: bool, notes: list[str]) -> tuple[Tokenizer, list[str]]:
    """``tok`` padded with placeholders to ``vocab_size`` and given the special tokens it lacks
    (a decoder: only [EOS])."""
    if tok.get_vocab_size() > vocab_size:
        raise MheError(f"{path}: the tokenizer has {tok.get_vocab_size()} entries, more than the model's "
                       f"{vocab_size}")
    gap = vocab_size - tok.get_vocab_size()
    if gap:
        tok.add_special_tokens([f"[unused-{i}]" for i in range(gap)])
        notes.append(f"tokenizer: {gap} placeholder(s) fill the model's vocabulary of {vocab_size}")
    have = set(tok.get_vocab(with_added_tokens=True))
    missing = [s for s in (["[EOS]"] if causal else SPECIALS) if s not in have]
    if missing:
        tok.add_special_tokens(missing)
        notes.append(f"tokenizer: {', '.join(missing)} added after the vocabulary (embeddings: the mean row)")
    return tok, notes


def _rename(node, names: dict[str, str]):
    """``node`` (parsed tokenizer JSON) with every string and key equal to a key of ``names``
    replaced by its value."""
    if isinstance(node, dict):
        return {names.get(k, k): _rename(v, names) for k, v in node.items()}
    if isinstance(node, list):
        return [_rename(v, names) for v in node]
    return names.get(node, node) if isinstance(node, str) else node


@torch.no_grad()
def grow_vocab(model: nn.Module, vocab_size: int) -> nn.Module:
    """``model`` with a vocabulary of ``vocab_size``: every tensor over the vocabulary (token
    embeddings, output rows, output bias) gets new entries equal to the mean of its rows."""
    old = model.cfg.vocab_size
    grown = build_model(model.cfg.replace(vocab_size=vocab_size)).to(next(model.parameters()).dtype)
    state = {}
    for k, t in model.state_dict().items():
        if t.dim() and t.shape[0] == old and grown.state_dict()[k].shape[0] == vocab_size:
            extra = t.mean(0, keepdim=True).expand(vocab_size - old, *t.shape[1:])
            t = torch.cat([t, extra])
        state[k] = t
    grown.load_state_dict(state, strict=True)
    return grown.train(model.training)


def data_task(source: Source, work: Path, device: torch.device):
    """The source's task set up on its data (``source.cfg.data``) with the source's tokenizer:
    for scores and calibration. ``work`` is a folder that may receive ``tokenizer.json``."""
    if not source.cfg.data.dataset and source.cfg.task in ("lm", "mlm"):
        raise MheError(f"scoring {source.path} needs a corpus: pass --data (ptb, wikitext-2, wikitext-103, "
                       "offline-english) or --no-eval")
    if not source.text:
        raise MheError(f"--data {source.cfg.data.dataset} is text, and {source.path} has no tokenizer: pass "
                       "--tokenizer DIR (a Hugging Face tokenizer folder or a run folder)")
    work.mkdir(parents=True, exist_ok=True)
    save_tokenizer(source.tokenizer, work)
    task = build_task(source.cfg.task)
    task.setup(copy.deepcopy(source.cfg), work, Dist(device=device))  # builds a model of its own: not used
    return task
