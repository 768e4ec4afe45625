"""Deterministic, resumable batch order shared by every task."""

from __future__ import annotations

import torch

from mhe.errors import MheError


class BatchOrder:
    """Yields lists of item indices: a fresh permutation per epoch, seeded by (seed, epoch).

    The position (epoch, batches taken this epoch) is the data position a
    checkpoint stores. With several processes each takes its contiguous share
    of every global batch, so the global batch is the same for any world size.
    The epoch's permutation is drawn once and kept: drawing it for every batch cost
    O(items) a step (7.5 ms at 1.15 million items, 230 ms at 10 million, on a 2-core CPU).
    """

    def __init__(self, n_items: int, batch_size: int, *, seed: int, rank: int = 0, world: int = 1,
                 shuffle: bool = True) -> None:
        if batch_size % world:
            raise MheError(f"global batch {batch_size} is not divisible by {world} processes")
        if n_items < batch_size:
            raise MheError(f"only {n_items} training items for a batch of {batch_size}; lower train.batch_size")
        self.n, self.batch, self.seed, self.rank, self.world, self.shuffle = n_items, batch_size, seed, rank, world, shuffle
        self.epoch, self.index = 0, 0
        self._kept: tuple[int, torch.Tensor] | None = None  # (epoch, its permutation)

    def _perm(self) -> torch.Tensor:
        """The current epoch's order, seeded by (seed, epoch), drawn on the first batch this
        object takes in that epoch (after a resume, the first one taken)."""
        if self._kept is None or self._kept[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
                self._kept = (self.epoch, torch.randperm(self.n, generator=g))
            else:
                self._kept = (self.epoch, torch.arange(self.n))
        return self._kept[1]

    def next(self) -> list[int]:
        per_epoch = self.n // self.batch
        if self.index >= per_epoch:
            self.epoch, self.index = self.epoch + 1, 0
        perm = self._perm()
        start = self.index * self.batch
        share = self.batch // self.world
        ids = perm[start + self.rank * share: start + (self.rank + 1) * share]
        self.index += 1
        return ids.tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, s: dict) -> None:
        self.epoch, self.index = int(s["epoch"]), int(s["index"])
