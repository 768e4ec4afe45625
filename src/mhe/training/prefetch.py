"""The next batch collated, pinned and copied to the device while the current step runs.

CUDA runs asynchronously: once a step's backward pass is queued, the host is idle until the
next step needs its batch. :class:`Prefetcher` uses that time: :meth:`~Prefetcher.prepare`
collates the following batch on the host, pins it and starts its copy (``non_blocking``)
behind the queued work, so the next step finds it on the device.

Exact resume is kept: a prepared batch is not *taken* until :meth:`~Prefetcher.next` hands
it out, so the data position (:class:`~mhe.training.batches.BatchOrder`, saved in every
checkpoint) still counts the batches the steps consumed, and :meth:`~Prefetcher.rewind`
(called before a checkpoint or an evaluation) drops a prepared batch and puts the host's
random generators back where they were before it was collated (masked-LM collators draw
from them). A resumed run then collates that batch again with the same random numbers.
"""

from __future__ import annotations

import random
from typing import Callable

import numpy as np
import torch

from mhe.training.batches import BatchOrder


class Prefetcher:
    """Hands out the batches of ``order`` on ``device``.

    Args:
        order: the run's batch order (its position is the data position a checkpoint saves).
        collate: item indices -> a batch dict (tensors on the host).
        device: where the steps run.
        ahead: prepare the next batch during the current step (CUDA); off, each batch is
            collated when it is taken, exactly as without a prefetcher.
    """

    def __init__(self, order: BatchOrder, collate: Callable[[list[int]], dict], device: torch.device, *,
                 ahead: bool) -> None:
        self.order, self.collate, self.device, self.ahead = order, collate, device, ahead
        self._ready: tuple[dict, dict, tuple] | None = None  # (batch, order position after it, host RNGs before it)

    def next(self) -> dict:
        """The next batch, on the device; the order counts it as taken."""
        if self._ready is None:
            return self._copy(self.collate(self.order.next()))
        batch, after, _ = self._ready
        self._ready = None
        self.order.load_state_dict(after)
        return batch

    def prepare(self) -> None:
        """Collate and start copying the batch after the last one taken (no-op unless ``ahead``)."""
        if not self.ahead or self._ready is not None:
            return
        rngs = _host_rngs()
        before = self.order.state_dict()
        ids = self.order.next()
        after = self.order.state_dict()
        self.order.load_state_dict(before)  # not taken yet
        self._ready = (self._copy(self.collate(ids)), after, rngs)

    def rewind(self) -> None:
        """Forget a prepared batch: the host generators go back to before it was collated."""
        if self._ready is not None:
            _set_host_rngs(self._ready[2])
            self._ready = None

    def _copy(self, batch: dict) -> dict:
        pin = self.device.type == "cuda"
        return {k: (v.pin_memory() if pin else v).to(self.device, non_blocking=True) if torch.is_tensor(v) else v
                for k, v in batch.items()}


def _host_rngs() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _set_host_rngs(state: tuple) -> None:
    torch.set_rng_state(state[0])
    random.setstate(state[1])
    np.random.set_state(state[2])
