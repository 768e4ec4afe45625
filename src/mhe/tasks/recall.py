"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), generated in-package.

Each sequence lists ``pairs`` key-value pairs, then asks for ``queries`` of the
keys again; the model must emit each key's value right after the key. MQAR is
known to separate attention variants at tiny scale, needs no download, and is
deterministic: the same ``data_seed`` gives the same data on any machine.

Tokens: 0 = [PAD], keys 1..n_keys, values n_keys+1..n_keys+n_values.
Score: accuracy over the queried values (higher is better).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from mhe.errors import MheError
from mhe.models import build_model
from mhe.models.losses import IGNORE, causal_lm_loss
from mhe.tasks.settings import RECALL_MODEL, RECALL_TRAIN, RecallOptions, RecallSettings  # noqa: F401 (re-exported)


def make_recall(n: int, *, n_keys: int, n_values: int, pairs: int, queries: int, seed: int):
    """``n`` sequences ``[B, 2*(pairs+queries)]`` and their labels (-100 where nothing is asked)."""
    if pairs > n_keys:
        raise MheError(f"recall needs pairs <= n_keys, got pairs={pairs}, n_keys={n_keys}")
    if queries > pairs:
        raise MheError(f"recall needs queries <= pairs, got queries={queries}, pairs={pairs}")
    g = torch.Generator().manual_seed(seed)
    keys = torch.argsort(torch.rand(n, n_keys, generator=g), dim=1)[:, :pairs] + 1  # distinct keys
    values = torch.randint(n_keys + 1, n_keys + n_values + 1, (n, pairs), generator=g)
    ask = torch.argsort(torch.rand(n, pairs, generator=g), dim=1)[:, :queries]
    qk, qv = keys.gather(1, ask), values.gather(1, ask)
    context = torch.stack([keys, values], 2).reshape(n, 2 * pairs)
    probe = torch.stack([qk, qv], 2).reshape(n, 2 * queries)
    x = torch.cat([context, probe], 1)  # [B, 2p + 2q]
    labels = torch.full_like(x, IGNORE)
    labels[:, 2 * pairs + 1::2] = qv  # the value after each queried key
    return x, labels


class RecallTask(RecallSettings):
    """Recall's data (generated), loss and accuracy, on top of its settings (:mod:`mhe.tasks.settings`)."""

    def check(self, cfg):
        if cfg.model.arch != "decoder":
            raise MheError(f"recall trains a decoder; got {cfg.preset!r} ({cfg.model.arch})")

    def setup(self, cfg, out: Path, dist):
        self.cfg = cfg
        o = dataclasses.asdict(cfg.data.task_options)  # RecallOptions, checked when the run was built
        gen = dict(n_keys=o["n_keys"], n_values=o["n_values"], pairs=o["pairs"], queries=o["queries"])
        self.x, self.y = make_recall(o["train_size"], seed=o["data_seed"], **gen)
        self.tx, self.ty = make_recall(o["test_size"], seed=o["data_seed"] + 1, **gen)
        vocab = o["n_keys"] + o["n_values"] + 1
        model = build_model(cfg.model, vocab_size=vocab)
        if model.cfg.arch != "decoder":
            raise MheError(f"recall trains a decoder; got {cfg.preset!r} ({model.cfg.arch})")
        if model.cfg.max_len < self.x.shape[1]:
            raise MheError(f"recall sequences have {self.x.shape[1]} tokens, more than max_len {model.cfg.max_len}")
        return model

    def n_train_items(self):
        return self.x.shape[0]

    def collate(self, indices):
        y = self.y[indices]
        return {"input_ids": self.x[indices], "labels": y, "n_tokens": int((y[:, 1:] != IGNORE).sum())}

    def loss(self, model, batch, *, chunked_loss=None):  # scores its logits: no chunked loss
        x, y = batch["input_ids"], batch["labels"]
        loss = causal_lm_loss(model(x).logits, y)  # position t predicts t+1
        return loss, batch["n_tokens"]  # counted on the host: no device sync

    def evaluate(self, model):
        dev = next(model.parameters()).device
        correct = total = 0
        for i in range(0, self.tx.shape[0], 250):
            x, y = self.tx[i:i + 250].to(dev), self.ty[i:i + 250].to(dev)
            pred = model(x).logits[:, :-1].argmax(-1)
            sel = y[:, 1:] != IGNORE
            correct += int((pred[sel] == y[:, 1:][sel]).sum())
            total += int(sel.sum())
        return {"accuracy": correct / total}

    def final(self, model):
        res = self.evaluate(model)
        return {"split": "test", "score": res["accuracy"], **res}
