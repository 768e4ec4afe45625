"""Masked language modelling (BERT; paper section 4.4 pre-training objective)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mhe.data.tokenize import load_tokenizer, special_id
from mhe.errors import MheError
from mhe.models import build_model
from mhe.tasks.init_from import init_weights, pretraining_tokenizer
from mhe.tasks.settings import MLMSettings
from mhe.tasks.text import check_text_data, corpus_lines, token_stream
from mhe.training.config import compile_wanted


def mask_tokens(ids: torch.Tensor, *, mask_id: int, vocab_size: int, special: torch.Tensor,
                prob: float = 0.15, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT's masking: choose 15% of the non-special tokens; of those 80% become [MASK],
    10% a random token, 10% stay. Returns (inputs, labels with -100 where not chosen)."""
    g = generator
    chosen = (torch.rand(ids.shape, generator=g) < prob) & ~torch.isin(ids, special)
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=g)
    inputs = ids.clone()
    inputs[chosen & (roll < 0.8)] = mask_id
    rand = chosen & (roll >= 0.8) & (roll < 0.9)
    inputs[rand] = torch.randint(0, vocab_size, ids.shape, generator=g)[rand]
    return inputs, labels


def masked_rows(eligible: int, prob: float = 0.15, multiple: int = 64) -> int:
    """A fixed number of head rows for batches with ``eligible`` maskable tokens: the mean
    number chosen plus six standard deviations (binomial), rounded up to ``multiple``, so that a
    compiled step sees one shape (a batch with more masked tokens, about one in 10^9, gets the
    next multiple and a recompilation)."""
    mean, sd = eligible * prob, math.sqrt(eligible * prob * (1 - prob))
    return min(eligible, -(-math.ceil(mean + 6 * sd) // multiple) * multiple)


def masked_positions(labels: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """The flat indices of ``labels != -100`` (row-major), padded with index 0 (a [CLS]
    position, never labelled) up to ``rows`` (or the next multiple of 64 past it)."""
    pos = (labels.flatten() != -100).nonzero().squeeze(1)  # [N]
    if rows is None:
        return pos
    if pos.numel() > rows:
        rows = -(-pos.numel() // 64) * 64
    return torch.cat([pos, pos.new_zeros(rows - pos.numel())])


class MaskedLMTask(MLMSettings):
    """Masked LM pre-training and its accuracy, on top of its settings (:mod:`mhe.tasks.settings`)."""

    def check(self, cfg):
        if cfg.model.arch != "encoder":
            raise MheError(f"masked language modelling needs an encoder preset, got {cfg.preset!r}")
        check_text_data(cfg, "masked language modelling", splits=("train", "valid"))

    def setup(self, cfg, out: Path, dist):
        self.check(cfg)
        self.cfg = cfg
        train = corpus_lines(cfg, "train")
        # continued pre-training: the source's tokenizer and weights
        source, self.tok = pretraining_tokenizer(cfg, out, train, task="mlm", dist=dist)
        model = self._build_model(cfg)
        if source:
            init_weights(model, source)
        self.blocks = self._pack(token_stream(self.tok, train, progress=cfg.train.progress,
                                              desc="tokenizing the training text"), self.seq)
        self.valid = self._pack(token_stream(self.tok, corpus_lines(cfg, "valid")), self.seq)[:256]
        self.static = compile_wanted(cfg.train, dist.device)  # one head size for the compiled step
        return model

    def setup_inference(self, cfg, out: Path, dist):
        """The model, the run's saved tokenizer and the validation split (``mhe eval``): the
        training text is not read."""
        self.cfg = cfg
        self.tok = load_tokenizer(out)
        model = self._build_model(cfg)
        self.valid = self._pack(token_stream(self.tok, corpus_lines(cfg, "valid")), self.seq)[:256]
        return model

    def _build_model(self, cfg):
        model = build_model(cfg.model, vocab_size=self.tok.get_vocab_size())
        if model.cfg.arch != "encoder":
            raise MheError(f"masked language modelling needs an encoder preset, got {cfg.preset!r}")
        self.vocab = self.tok.get_vocab_size()
        self.cls, self.sep = special_id(self.tok, "[CLS]"), special_id(self.tok, "[SEP]")
        self.mask_id = special_id(self.tok, "[MASK]")
        self.special = torch.tensor([special_id(self.tok, s) for s in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")])
        self.seq = min(cfg.data.seq_len or model.cfg.max_len, model.cfg.max_len)
        return model

    def _pack(self, stream: torch.Tensor, seq: int) -> torch.Tensor:
        """Sequences packed to the maximum length: [CLS] tokens... [SEP]."""
        body = seq - 2
        n = stream.numel() // body
        x = stream[: n * body].view(n, body)
        return torch.cat([torch.full((n, 1), self.cls), x, torch.full((n, 1), self.sep)], 1)

    def n_train_items(self):
        return self.blocks.shape[0]

    def collate(self, indices):
        inputs, labels = mask_tokens(self.blocks[indices], mask_id=self.mask_id, vocab_size=self.vocab,
                                     special=self.special)
        rows = masked_rows(inputs.numel() - 2 * inputs.shape[0]) if getattr(self, "static", False) else None
        pos = masked_positions(labels, rows)  # on the host: the step never reads the mask back
        return {"input_ids": inputs, "labels": labels, "masked_positions": pos,
                "n_tokens": int((labels != -100).sum())}

    def loss(self, model, batch, *, chunked_loss=None):
        # the model's forward (so a compiled or DDP-wrapped model runs it), the head on the masked rows only
        out = model(batch["input_ids"], labels=batch["labels"], masked_positions=batch["masked_positions"],
                    chunked_loss=chunked_loss)
        return out.loss, batch["n_tokens"]

    def evaluate(self, model):
        g = torch.Generator().manual_seed(12345)  # the same masks at every evaluation
        dev = next(model.parameters()).device
        correct = total = 0
        nll = 0.0
        for i in range(0, self.valid.shape[0], 32):
            inputs, labels = mask_tokens(self.valid[i:i + 32], mask_id=self.mask_id, vocab_size=self.vocab,
                                         special=self.special, generator=g)
            out = model.masked_lm_loss(inputs.to(dev), labels.to(dev))
            sel = labels != -100
            n = int(sel.sum())
            correct += int((out.logits.argmax(-1).cpu() == labels[sel]).sum())
            nll += out.loss.item() * n
            total += n
        return {"mlm_accuracy": correct / max(total, 1), "mlm_loss": nll / max(total, 1)}

    def final(self, model):
        res = self.evaluate(model)
        return {"split": "valid", "score": res["mlm_accuracy"], **res}
