""":class:`mhe.training.batches.BatchOrder`: each epoch a permutation seeded by (seed, epoch),
taken batch by batch (each process its contiguous share), drawn once an epoch, and resumable
from its (epoch, index) position."""

import torch

from mhe.training import batches
from mhe.training.batches import BatchOrder


def reference(n, batch, seed, steps, rank=0, world=1):
    """The order written out: epoch e's permutation is randperm(n) of a generator seeded
    seed * 1,000,003 + e; an epoch is n // batch batches; each process takes its share."""
    out, per_epoch, share = [], n // batch, batch // world
    for step in range(steps):
        epoch, index = divmod(step, per_epoch)
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        start = index * batch + rank * share
        out.append(perm[start:start + share].tolist())
    return out


def test_the_order_is_the_seeded_permutation_of_each_epoch_and_each_process_takes_its_share():
    """Over three epochs (the last items of an epoch that do not fill a batch are left out)."""
    order = BatchOrder(23, 4, seed=7)
    assert [order.next() for _ in range(15)] == reference(23, 4, 7, 15)
    for rank in (0, 1):
        two = BatchOrder(23, 4, seed=7, rank=rank, world=2)
        assert [two.next() for _ in range(15)] == reference(23, 4, 7, 15, rank=rank, world=2)
    assert BatchOrder(8, 4, seed=1, shuffle=False).next() == [0, 1, 2, 3]


def test_the_permutation_is_drawn_once_an_epoch(monkeypatch):
    """A prefetcher saves and restores the position around every batch it prepares; the
    permutation is still drawn once an epoch (it was drawn for every batch: O(items) a step)."""
    drawn = []
    real = torch.randperm
    monkeypatch.setattr(batches.torch, "randperm", lambda *a, **k: drawn.append(a[0]) or real(*a, **k))
    order = BatchOrder(1000, 10, seed=3)
    for _ in range(250):  # two and a half epochs of 100 batches
        before = order.state_dict()
        order.next()
        order.load_state_dict(before)
        order.next()
    assert drawn == [1000, 1000, 1000]


def test_a_resumed_order_continues_as_if_never_stopped():
    """Loading a position of another epoch draws that epoch's permutation, not the kept one."""
    whole = BatchOrder(50, 8, seed=2)
    expected = [whole.next() for _ in range(20)]
    first = BatchOrder(50, 8, seed=2)
    head = [first.next() for _ in range(9)]  # into epoch 1 (6 batches an epoch)
    again = BatchOrder(50, 8, seed=2)
    again.next()  # epoch 0's permutation kept
    again.load_state_dict(first.state_dict())
    assert head + [again.next() for _ in range(11)] == expected
    back = BatchOrder(50, 8, seed=2)
    for _ in range(13):
        back.next()  # epoch 2's permutation kept
    back.load_state_dict({"epoch": 0, "index": 0})
    assert [back.next() for _ in range(20)] == expected
