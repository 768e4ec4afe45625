"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"), generated in-package.

Each sequence lists ``pairs`` key-value pairs, then asks for ``queries`` of the
keys again; the model must emit each key's value right after the key. MQAR is
known to separate attention variants at tiny scale, needs no download, and is
deterministic: the same ``data_seed`` gives the same data on any machine.

Tokens: 0 = [PAD], keys 1..n_keys, values n_keys+1..n_keys+n_values.
Score: accuracy over the queried values (higher is better).

Two layouts (``data.task_options.seq_len``): packed (0, the queries right after the pairs) and
Zoology's (N tokens: the pairs, then each query at a power-law distance into the rest, the gaps
padding; :func:`make_zoology_recall`). A data set is generated once per process and options
(:func:`recall_data`) and kept on disk in the cache folder, so the many small runs of a study
that share a sequence length read it instead of drawing it again. The loss and the accuracy
compute the output layer only at the queried positions (``score_at``): with Zoology's vocabulary
of 8,192 the output layer over every position would cost more than the two layers below it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from mhe.errors import MheError
from mhe.models import build_model
from mhe.models.losses import IGNORE
from mhe.runtime import cache_root
from mhe.training.atomic import write_bytes_atomic
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


ZOOLOGY_POWER_A = 0.01
"""Zoology's ``power_a``: a query sits ``g`` slots into the rest of the sequence with probability
proportional to ``g ** (power_a - 1)``, so most queries come soon after the pairs, a few far."""


def _distinct(n: int, pool: int, k: int, g: torch.Generator, chunk: int = 4096) -> torch.Tensor:
    """``[n, k]`` distinct draws from ``0..pool-1`` per row (uniform), in row chunks so a
    vocabulary of thousands over 100,000 rows never needs one ``[n, pool]`` matrix."""
    return torch.cat([torch.rand(min(chunk, n - i), pool, generator=g).topk(k, dim=1).indices
                      for i in range(0, n, chunk)])


def make_zoology_recall(n: int, *, n_keys: int, n_values: int, pairs: int, queries: int, seq_len: int,
                        seed: int, power_a: float = ZOOLOGY_POWER_A):
    """``n`` sequences ``[n, seq_len]`` laid out as Zoology's MQAR (Arora et al. 2023): ``pairs``
    distinct keys each followed by its value, then the rest of the sequence as slots of two tokens;
    ``queries`` of the keys, each in a distinct slot chosen with probability proportional to
    ``slot ** (power_a - 1)`` (slots counted from 1), the value to be named at the token after it.
    Everything else is padding (0). Labels: the value at the position after each queried key, -100
    elsewhere (position t is scored on label t+1, as in the packed layout)."""
    context = 2 * pairs
    slots = (seq_len - context) // 2
    if pairs > n_keys or queries > pairs or slots < queries:
        raise MheError(f"recall needs pairs <= n_keys, queries <= pairs and seq_len >= 2 x (pairs + queries); "
                       f"got n_keys={n_keys}, pairs={pairs}, queries={queries}, seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    keys = _distinct(n, n_keys, pairs, g) + 1
    values = torch.randint(n_keys + 1, n_keys + n_values + 1, (n, pairs), generator=g)
    ask = _distinct(n, pairs, queries, g)  # which pairs are asked, in a random order
    weight = torch.arange(1, slots + 1, dtype=torch.float64) ** (power_a - 1)
    where = torch.multinomial(weight.expand(n, slots), queries, replacement=False, generator=g)
    x = torch.zeros(n, seq_len, dtype=torch.long)
    x[:, :context] = torch.stack([keys, values], 2).reshape(n, context)
    pos = context + 2 * where  # the queried keys' positions
    x.scatter_(1, pos, keys.gather(1, ask))
    labels = torch.full_like(x, IGNORE)
    labels.scatter_(1, pos + 1, values.gather(1, ask))
    return x, labels


GENERATOR = 1
"""The version of the generators' drawing, part of the cache's key: raise it when a generator
draws differently, so no cached data set of the old drawing is read."""


def _generate(o: dict, split: str):
    gen = dict(n_keys=o["n_keys"], n_values=o["n_values"], pairs=o["pairs"], queries=o["queries"])
    n, seed = (o["train_size"], o["data_seed"]) if split == "train" else (o["test_size"], o["data_seed"] + 1)
    if o.get("seq_len"):
        return make_zoology_recall(n, seq_len=o["seq_len"], seed=seed, **gen)
    return make_recall(n, seed=seed, **gen)


@functools.lru_cache(maxsize=2)
def _recall_data(key: str):
    o = json.loads(key)
    root = cache_root()
    file = None
    if root is not None:
        name = hashlib.sha256(key.encode()).hexdigest()[:16]
        file = root / "recall" / f"{name}.pt"
        if file.is_file():
            return torch.load(file)
    data = {split: tuple(t.to(torch.int16) for t in _generate(o, split)) for split in ("train", "test")}
    if file is not None:  # atomic: processes drawing the same data at once write the same bytes
        import io
        buf = io.BytesIO()
        torch.save(data, buf)
        file.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(file, buf.getvalue())
    return data


def recall_data(options) -> dict:
    """``{"train": (x, labels), "test": (x, labels)}`` of a run's :class:`RecallOptions`: drawn
    once per process (the two newest kept) and kept in the cache folder (``MHE_CACHE_DIR``,
    ``off``: not kept), since the data depend on the options alone. Held as int16 (a quarter of
    the memory: 100,000 sequences of 512 are 100 MB) and widened batch by batch."""
    if options.n_keys + options.n_values >= 2 ** 15:
        raise MheError(f"recall keeps its tokens as int16: n_keys + n_values must be below 32,768, got "
                       f"{options.n_keys + options.n_values}")
    return _recall_data(json.dumps({**dataclasses.asdict(options), "generator": GENERATOR}, sort_keys=True))


def scored_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions ``[B, K]`` whose next token is asked for and those tokens ``[B, K]``; every
    row of a recall batch asks the same number (``queries``), so the shapes are fixed."""
    asked = labels[:, 1:] != IGNORE
    k = int(asked[0].sum())
    pos = torch.sort(asked.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :k]
    return pos, labels[:, 1:].gather(1, pos)


class RecallTask(RecallSettings):
    """Recall's data (generated), loss and accuracy, on top of its settings (:mod:`mhe.tasks.settings`)."""

    def check(self, cfg):
        if cfg.model.arch != "decoder":
            raise MheError(f"recall trains a decoder; got {cfg.preset!r} ({cfg.model.arch})")

    def setup(self, cfg, out: Path, dist):
        self.cfg = cfg
        o = cfg.data.task_options  # RecallOptions, checked when the run was built
        data = recall_data(o)
        self.x, self.y = data["train"]
        self.tx, self.ty = data["test"]
        vocab = o.n_keys + o.n_values + 1
        model = build_model(cfg.model, vocab_size=vocab)
        if model.cfg.arch != "decoder":
            raise MheError(f"recall trains a decoder; got {cfg.preset!r} ({model.cfg.arch})")
        if model.cfg.max_len < self.x.shape[1]:
            raise MheError(f"recall sequences have {self.x.shape[1]} tokens, more than max_len {model.cfg.max_len}")
        return model

    def n_train_items(self):
        return self.x.shape[0]

    def collate(self, indices):
        y = self.y[indices].long()
        pos, target = scored_positions(y)
        return {"input_ids": self.x[indices].long(), "score_at": pos, "targets": target, "n_tokens": target.numel()}

    def loss(self, model, batch, *, chunked_loss=None):  # scores its logits: no chunked loss
        logits = model(batch["input_ids"], score_at=batch["score_at"]).logits  # [B, K, V]
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        return loss, batch["n_tokens"]  # counted on the host: no device sync

    def evaluate(self, model):
        dev = next(model.parameters()).device
        correct = total = 0
        for i in range(0, self.tx.shape[0], 250):
            pos, target = scored_positions(self.ty[i:i + 250].long())
            logits = model(self.tx[i:i + 250].long().to(dev), score_at=pos.to(dev)).logits
            correct += int((logits.argmax(-1) == target.to(dev)).sum())
            total += target.numel()
        return {"accuracy": correct / total}

    def final(self, model):
        res = self.evaluate(model)
        return {"split": "test", "score": res["accuracy"], **res}
