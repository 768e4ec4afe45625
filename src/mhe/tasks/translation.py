"""Translation with the encoder-decoder (paper Table 3): shared sub-word vocabulary,
token-based batches, label smoothing, beam search, sacrebleu.

``data.task_options`` are :class:`mhe.tasks.translation_config.TranslationOptions`:
``src``/``tgt`` languages, ``max_tokens`` per batch (source + target tokens,
padding included), ``beam``, ``alpha`` (length penalty), ``eval_sentences``
(validation sentences decoded at each evaluation), ``protocol``: ``best`` (test
BLEU of the best validation checkpoint) or ``last5`` (the paper's: each of the last
``last_n`` checkpoints decoded with the final beam settings, their test BLEU averaged;
see :mod:`mhe.tasks.mt_protocol`), ``average_weights`` (with ``last5``: also decode the
average of those checkpoints' weights), ``checkpoint_every``: ``"epoch"`` sets
``train.save_every`` to one epoch's batches (or leave it to ``train.save_every`` steps).
``docs/wmt14.md`` gives the layout.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch

from mhe.attention.folding import weights_version
from mhe.data.parallel_text import parallel_files, read_parallel
from mhe.data.tokenize import load_tokenizer, special_id
from mhe.errors import MheError
from mhe.metrics.bleu import corpus_bleu
from mhe.models import build_model
from mhe.models.beam_search import BeamSearcher, beam_search, source_bucket
from mhe.models.losses import IGNORE
from mhe.progress import bar
from mhe.tasks.settings import TranslationSettings
from mhe.tasks.mt_protocol import averaged_checkpoint_score, last_checkpoint_scores
from mhe.tasks.text import pad_rows, tokenizer_for
from mhe.tasks.translation_config import TranslationOptions  # noqa: F401 (re-exported)
from mhe.training.averaging import last_checkpoints

PROTOCOLS = ("best", "last5")
DECODE_DTYPES = ("float32", "bfloat16")


def decode_batches(lengths: list[int], order: list[int], *, sentences: int, beam: int, max_len: int,
                   max_tokens: int) -> list[list[int]]:
    """Consecutive runs of ``order`` (sources sorted by length) decoded together: at most
    ``sentences`` each, and fewer where sentences x beam x (source length rounded up to a
    multiple of 32 + ``max_len``), the cache rows a batch holds, would pass ``max_tokens``."""
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        width = source_bucket(max(1, max(lengths[j] for j in cur + [i]))) + max_len
        if cur and (len(cur) >= sentences or (len(cur) + 1) * beam * width > max_tokens):
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


def token_batches(src_lens: list[int], tgt_lens: list[int], max_tokens: int) -> list[list[int]]:
    """Group pair indices, sorted by length, into batches whose padded size
    (rows x (longest source + longest target)) stays within ``max_tokens``."""
    order = sorted(range(len(src_lens)), key=lambda i: (src_lens[i], tgt_lens[i]))
    batches, cur, ms, mt = [], [], 0, 0
    for i in order:
        ns, nt = max(ms, src_lens[i]), max(mt, tgt_lens[i])
        if cur and (len(cur) + 1) * (ns + nt) > max_tokens:
            batches.append(cur)
            cur, ns, nt = [], src_lens[i], tgt_lens[i]
        cur.append(i)
        ms, mt = ns, nt
    if cur:
        batches.append(cur)
    return batches


class TranslationTask(TranslationSettings):
    """Translation's data, loss, beam search and BLEU, on top of its settings (:mod:`mhe.tasks.settings`)."""

    def __init__(self) -> None:
        self.searcher: BeamSearcher | None = None  # the beam searcher of the model decoded last (_searcher)
        self.cast: tuple | None = None  # ((id, weights version, dtype), the model's bf16 copy) (_decoding_model)

    def check(self, cfg):
        if cfg.model.arch != "encoder-decoder":
            raise MheError(f"translation needs an encoder-decoder preset, got {cfg.preset!r}")
        o = cfg.data.task_options
        _check_protocol(cfg, dataclasses.asdict(o))
        for split in ("train", "valid", "test"):
            if cfg.data.source == "local":
                parallel_files(cfg.data.dataset or "multi30k", split, o.src, o.tgt, data_dir=cfg.data.data_dir or None)

    def setup(self, cfg, out: Path, dist):
        self.cfg, self.out = cfg, out
        o = dataclasses.asdict(cfg.data.task_options)  # TranslationOptions, checked when the run was built
        self.o = o
        _check_protocol(cfg, o)
        name = cfg.data.dataset or "multi30k"
        self.dataset = name
        d = dict(data_dir=cfg.data.data_dir or None, source=cfg.data.source)
        limit = cfg.data.limit_lines or None
        train_src, train_tgt = read_parallel(name, "train", o["src"], o["tgt"], limit=limit, **d)
        self.valid = read_parallel(name, "valid", o["src"], o["tgt"], **d)
        # the preset's convention (section 4.4): one joint vocabulary of both languages
        self.tok = tokenizer_for(cfg, out, train_src + train_tgt, task="mt", dist=dist, word_level_corpus=False)
        model = self._build_model(cfg)
        self.src_ids = [self._encode(s) for s in train_src]
        self.tgt_ids = [self._encode(t) for t in train_tgt]
        self.batches = token_batches([len(x) for x in self.src_ids], [len(y) + 1 for y in self.tgt_ids],
                                     int(o["max_tokens"]))
        if o["checkpoint_every"] == "epoch":  # one checkpoint per pass over the data (the paper's epochs)
            cfg.train.save_every = len(self.batches) // max(1, cfg.train.batch_size) or 1
        return model

    def setup_inference(self, cfg, out: Path, dist):
        """The model and the run's saved tokenizer, for translating with a finished run: no
        corpus is read (``mhe translate`` needs only the run folder)."""
        self.cfg, self.out = cfg, out
        self.o = dataclasses.asdict(cfg.data.task_options)
        self.dataset = cfg.data.dataset or "multi30k"
        self.tok = load_tokenizer(out)
        return self._build_model(cfg)

    def _build_model(self, cfg):
        self.bos, self.eos, self.pad = (special_id(self.tok, t) for t in ("[BOS]", "[EOS]", "[PAD]"))
        model = build_model(cfg.model, vocab_size=self.tok.get_vocab_size(), pad_id=self.pad)
        if model.cfg.arch != "encoder-decoder":
            raise MheError(f"translation needs an encoder-decoder preset, got {cfg.preset!r}")
        self.max_len = model.cfg.max_len
        return model

    def _encode(self, text: str) -> list[int]:
        """Sub-word ids, truncated so that BOS/EOS fit the model's max_len (the documented rule)."""
        return self.tok.encode(text, add_special_tokens=False).ids[: self.max_len - 2]

    def n_train_items(self):
        return len(self.batches)

    def collate(self, indices):
        rows = [i for b in indices for i in self.batches[b]]
        src = pad_rows([self.src_ids[i] for i in rows], self.pad)
        tgt_in = pad_rows([[self.bos] + self.tgt_ids[i] for i in rows], self.pad)
        labels = pad_rows([self.tgt_ids[i] + [self.eos] for i in rows], IGNORE)
        return {"src": src, "src_mask": src != self.pad, "tgt": tgt_in, "tgt_mask": labels != -100,
                "labels": labels, "n_tokens": int((labels != IGNORE).sum())}

    def loss(self, model, batch, *, chunked_loss=None):
        out = model(batch["src"], batch["tgt"], batch["src_mask"], batch["tgt_mask"], labels=batch["labels"],
                    label_smoothing=self.cfg.train.label_smoothing, return_logits=False, chunked_loss=chunked_loss)
        return out.loss, batch["n_tokens"]  # counted on the host: no device sync

    # ------------------------------------------------------------------ decoding
    def translate(self, model, sources: list[str], *, beam: int | None = None, alpha: float | None = None,
                  progress: bool = False, dtype: str | None = None, step_mode: str = "auto",
                  compile_options: dict | None = None) -> list[str]:
        """Detokenised translations, in input order; ``progress``: count the sentences decoded on
        a bar (standard error); ``dtype``: ``float32`` or ``bfloat16`` (default: the run's
        ``decode_dtype``); ``step_mode`` and ``compile_options``: the beam searcher's decode step
        (:class:`~mhe.models.beam_search.BeamSearcher`). Sources are sorted by length and decoded in large batches
        (:func:`decode_batches`); padding is masked, so a sentence's translation does not
        depend on the batch it is in."""
        model.eval()
        dev = next(model.parameters()).device
        beam = int(beam or self.o["beam"])
        alpha = float(self.o["alpha"] if alpha is None else alpha)
        run = self._decoding_model(model, dtype or self.o.get("decode_dtype", "float32"))
        ids = [self._encode(s) for s in sources]
        # an empty (or blank) source line becomes an empty translation: nothing is invented
        order = sorted((i for i in range(len(ids)) if sources[i].strip()), key=lambda i: len(ids[i]))
        batches = decode_batches([len(x) for x in ids], order, sentences=int(self.o["eval_batch"]), beam=beam,
                                 max_len=self.max_len, max_tokens=int(self.o.get("decode_tokens", 262144)))
        out: list[str] = [""] * len(ids)
        searcher = self._searcher(run, step_mode, compile_options)
        with bar(len(order), desc=f"decoding (beam {beam})", unit="sentence", enabled=progress) as shown:
            for chunk in batches:
                src = pad_rows([ids[i] or [self.tok.token_to_id("[UNK]")] for i in chunk], self.pad).to(dev)
                hyp = beam_search(run, src, src != self.pad, bos_id=self.bos, eos_id=self.eos, beam=beam,
                                  max_len=self.max_len, alpha=alpha, searcher=searcher).tolist()
                for row, i in enumerate(chunk):
                    toks = hyp[row][1:]
                    toks = toks[: toks.index(self.eos)] if self.eos in toks else toks
                    out[i] = self.tok.decode(toks, skip_special_tokens=True).strip()
                shown.update(len(chunk))
        return out

    def _searcher(self, model, step_mode: str = "auto", compile_options: dict | None = None) -> BeamSearcher:
        """The beam searcher of ``model`` with these step options, kept across calls: batches of one
        shape share its captured steps (it rebuilds them when the weights change)."""
        s = self.searcher
        if s is None or s.model is not model or (s.step_mode, s.compile_options) != (step_mode, compile_options):
            self.searcher = BeamSearcher(model, step_mode=step_mode, compile_options=compile_options)
        return self.searcher

    def _decoding_model(self, model, dtype: str):
        """``model`` itself for float32; a bfloat16 copy (kept while the weights do not change) otherwise.
        The copy's weights are the model's rounded to bfloat16, nothing else; ``model`` is left as it was."""
        if dtype not in DECODE_DTYPES:
            raise MheError(f"decoding dtype must be one of {', '.join(DECODE_DTYPES)}, got {dtype!r}")
        want = getattr(torch, dtype)
        if next(model.parameters()).dtype == want:
            return model
        key = (id(model), weights_version(model), dtype)
        if self.cast is None or self.cast[0] != key:
            self.cast = (key, copy.deepcopy(model).to(want).eval())
        return self.cast[1]

    def evaluate(self, model):
        n = int(self.o["eval_sentences"])
        src, ref = self.valid[0][:n], self.valid[1][:n]
        return {"bleu": corpus_bleu(self.translate(model, src, beam=1), ref)["bleu"]}

    def _test(self):
        d = dict(data_dir=self.cfg.data.data_dir or None, source=self.cfg.data.source)
        return read_parallel(self.dataset, "test", self.o["src"], self.o["tgt"],
                             limit=int(self.o["test_sentences"]) or None, **d)

    def final(self, model):
        src, ref = self._test()
        hyps = self.translate(model, src, progress=self.cfg.train.progress)
        bleu = corpus_bleu(hyps, ref)
        (self.out / "test_translations.txt").write_text("\n".join(hyps) + "\n")
        res = {"split": "test", "score": bleu["bleu"], "bleu": bleu["bleu"], "signature": bleu["signature"],
               "beam": int(self.o["beam"]), "alpha": float(self.o["alpha"])}
        if self.o["protocol"] == "last5":
            res.update(self.last_checkpoints_bleu(model, src, ref))
            res["score"] = res["bleu_last5_mean"]  # the paper's figure
        return res

    def last_checkpoints_bleu(self, model, src: list[str], ref: list[str]) -> dict:
        """Test BLEU of each of the last ``last_n`` checkpoints with the final beam settings, their
        mean and, with ``average_weights``, the BLEU of their averaged weights (section 4.4)."""
        points = last_checkpoints(self.out / "checkpoints", int(self.o["last_n"]))
        shown = self.cfg.train.progress
        bleu = lambda m: corpus_bleu(self.translate(m, src, progress=shown), ref)["bleu"]  # noqa: E731
        per = last_checkpoint_scores(model, points, bleu)
        res = {"bleu_last5": per["scores"], "bleu_last5_steps": per["steps"], "bleu_last5_mean": per["mean"]}
        if self.o["average_weights"]:
            res["bleu_averaged_weights"] = averaged_checkpoint_score(model, points, bleu)
        return res


def _check_protocol(cfg, o: dict) -> None:
    """One-line errors for a protocol the run cannot carry out."""
    if o["protocol"] not in PROTOCOLS:
        raise MheError(f"unknown translation protocol {o['protocol']!r}; valid: {', '.join(PROTOCOLS)}")
    if o["checkpoint_every"] not in ("", "epoch"):
        raise MheError(f"checkpoint_every takes \"epoch\" or \"\" (train.save_every), got {o['checkpoint_every']!r}")
    if o["protocol"] == "last5":
        n = int(o["last_n"])
        if n <= 0 or cfg.train.keep_last < n or not cfg.train.keep_checkpoints:
            raise MheError(f"protocol last5 keeps the last {n} checkpoints: set train.keep_last={max(n, 1)} "
                           f"(got {cfg.train.keep_last}) and train.keep_checkpoints=true")
