"""Causal language modelling on PTB / WikiText (paper Table 2): train, then perplexity."""

from __future__ import annotations

from pathlib import Path

from mhe.data.corpora import check_corpus, word_count
from mhe.data.tokenize import describe_tokenizer, load_tokenizer
from mhe.errors import MheError
from mhe.metrics.perplexity import perplexity, sliding_window_nll
from mhe.models import build_model
from mhe.models.config import cpu_sized
from mhe.tasks.catalogue import read_run_config
from mhe.tasks.cross_eval import corpus_perplexity
from mhe.tasks.distill import Distiller, load_teacher
from mhe.tasks.init_from import init_weights, pretraining_tokenizer
from mhe.tasks.settings import LMSettings
from mhe.tasks.text import check_text_data, corpus_lines, is_word_level, token_stream
from mhe.training.run_files import require_run_dir
from mhe.training.run_report import phase


# Tiny presets with a large vocabulary (word-level WikiText-2: 33k) use an adaptive softmax:
# the full softmax would be ~90% of a CPU step.
ADAPTIVE_FROM = 20_000
ADAPTIVE_CUTOFFS = (2000, 10000)


class CausalLMTask(LMSettings):
    """Causal LM pre-training and its sliding-window perplexity, on top of its settings."""

    def check(self, cfg):
        if cfg.model.arch != "decoder":
            raise MheError(f"causal language modelling needs a decoder preset, got {cfg.preset!r} ({cfg.model.arch})")
        check_text_data(cfg, "language modelling")
        if cfg.train.distill_from:  # the teacher's folder, before any data is read
            require_run_dir(cfg.train.distill_from, "train.distill_from")
        for name in cfg.data.task_options.also_test:  # their files there before training starts
            check_corpus(name, ("test",), data_dir=cfg.data.data_dir or None, source=cfg.data.source)

    def setup(self, cfg, out: Path, dist):
        self.check(cfg)
        self.cfg = cfg
        train = corpus_lines(cfg, "train")
        self.valid_lines = corpus_lines(cfg, "valid")
        self.test_lines = corpus_lines(cfg, "test")  # read now: a bad test split fails before training
        # continued pre-training: the source's tokenizer and weights
        source, self.tok = pretraining_tokenizer(cfg, out, train, task="lm", dist=dist)
        with phase("model"):
            model = self._build_model(cfg, dist)
        if source:
            init_weights(model, source)
        self.distiller = None
        if cfg.train.distill_from and cfg.train.distill_weight > 0:  # the teacher of train.distill_from
            teacher = load_teacher(cfg.train.distill_from, out, self.model_for, read_run_config)
            self.distiller = Distiller(teacher.to(dist.device), cfg.train.distill_weight,
                                       cfg.train.distill_temperature)
        self.max_len = model.cfg.max_len
        self.seq_len = min(cfg.data.seq_len or self.max_len, self.max_len)
        stream = token_stream(self.tok, train, progress=cfg.train.progress, desc="tokenizing the training text")
        n = (stream.numel() // self.seq_len) * self.seq_len
        self.blocks = stream[:n].view(-1, self.seq_len)  # [N, L] contiguous blocks
        self.valid = token_stream(self.tok, self.valid_lines)
        return model

    def setup_inference(self, cfg, out: Path, dist):
        """The model and the run's saved tokenizer, for generating with a finished run: no
        corpus is read (``mhe generate`` needs only the run folder)."""
        self.cfg = cfg
        self.tok = load_tokenizer(out)
        return self._build_model(cfg, dist)

    def model_for(self, cfg):
        """The (untrained) model of a run configured by ``cfg`` at this task's vocabulary."""
        vocab = self.tok.get_vocab_size()
        extra = {}
        if cpu_sized(cfg.preset) and vocab >= ADAPTIVE_FROM and not cfg.model.adaptive_cutoffs:
            extra["adaptive_cutoffs"] = [c for c in ADAPTIVE_CUTOFFS if c < vocab]
        return build_model(cfg.model, vocab_size=vocab, **extra)

    def _build_model(self, cfg, dist):
        self.device = dist.device
        model = self.model_for(cfg)
        if model.cfg.arch != "decoder":
            raise MheError(f"causal language modelling needs a decoder preset, got {cfg.preset!r} ({model.cfg.arch})")
        self.max_len = model.cfg.max_len
        # an adaptive softmax scores each cluster's rows, a number that changes with every batch
        self.static_shapes = not model.cfg.adaptive_cutoffs
        return model

    def n_train_items(self):
        return self.blocks.shape[0]

    def collate(self, indices):
        x = self.blocks[indices]
        return {"input_ids": x}

    def loss(self, model, batch, *, chunked_loss=None):
        x = batch["input_ids"]
        if getattr(self, "distiller", None) is not None:  # train.distill_from (mhe.tasks.distill)
            return self.distiller.loss(model, x), x.numel()
        return model(x, labels=x, return_logits=False, chunked_loss=chunked_loss).loss, x.numel()

    def _ppl(self, model, ids, lines, stride, *, progress: bool = False):
        nll, n = sliding_window_nll(model, ids, max_len=self.max_len, stride=stride,
                                    batch_size=self.cfg.data.eval_batch_size, device=self.device,
                                    progress=progress)
        word_level = is_word_level(self.tok)
        out = {"perplexity": perplexity(nll, n), "perplexity_per": "word" if word_level else "token",
               "tokenizer": describe_tokenizer(self.tok), "tokens": n, "nll": nll}
        words = word_count(lines)
        if not word_level:  # sub-word tokenizer: also report per word
            out["word_perplexity"] = perplexity(nll, words - 1)
            out["words"] = words - 1
        return out

    def evaluate(self, model):
        """Validation perplexity on disjoint windows (fast); the final figure uses the sliding window."""
        model.eval()
        return self._ppl(model, self.valid, self.valid_lines, self.max_len)

    def final(self, model):
        """The test split's sliding-window perplexity at :meth:`stride`: one pass, unless
        ``data.eval_second_stride`` asks for a second one (``perplexity_strideN``, with
        ``word_perplexity_strideN`` for sub-word tokenizers)."""
        model.eval()
        test_lines = self.test_lines
        stride = self.stride()
        ids = token_stream(self.tok, test_lines)
        shown = self.cfg.train.progress  # the sliding window runs for minutes on a CPU: show it
        res = self._ppl(model, ids, test_lines, stride, progress=shown)
        out = {"split": "test", "stride": stride, "score": res["perplexity"], **res}
        second = min(self.cfg.data.eval_second_stride, self.max_len)
        if second:  # asked for: e.g. the paper's 256 where it is capped at half the window
            extra = self._ppl(model, ids, test_lines, second, progress=shown)
            out[f"perplexity_stride{second}"] = extra["perplexity"]
            if "word_perplexity" in extra:
                out[f"word_perplexity_stride{second}"] = extra["word_perplexity"]
        for name in self.cfg.data.task_options.also_test:
            other = corpus_perplexity(self, model, self.cfg, name)
            out[f"{name}_perplexity"] = other["perplexity"]
            if "word_perplexity" in other:
                out[f"{name}_word_perplexity"] = other["word_perplexity"]
        return out

    def split_perplexity(self, model, split: str, *, progress: bool = False) -> dict:
        """Sliding-window perplexity of ``split`` (``valid`` or ``test``) at :meth:`stride`."""
        model.eval()
        lines = corpus_lines(self.cfg, split)
        res = self._ppl(model, token_stream(self.tok, lines), lines, self.stride(), progress=progress)
        return {"split": split, "stride": self.stride(), **res}

    def stride(self) -> int:
        """The paper's stride (256) but never more than half the window, so every scored
        token keeps at least half a window of context. ``data.eval_second_stride`` asks
        :meth:`final` for a second figure at another stride, e.g. the uncapped one (at most the
        window: then consecutive windows share one token)."""
        return max(1, min(self.cfg.data.eval_stride, self.max_len // 2))
