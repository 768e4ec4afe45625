"""The caches a model decodes with: one key/value buffer per layer written by one operation,
and one write position for the whole model, advanced once per forward."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mhe.attention import KVCache
from mhe.models import build_model

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=3, max_len=40, dropout=0.0, attn_dropout=0.0)


class OpCount(TorchDispatchMode):
    """Counts the aten operators run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("preset", ["tiny-decoder", "tiny-encoder-decoder"])
def test_a_models_caches_share_one_position_that_moves_once_a_forward(preset):
    model = build_model(preset, attention="mqa", **SMALL).double().eval()
    caches = model.new_caches(2, 10)
    selfs = [c[0] if isinstance(c, tuple) else c for c in caches]
    assert all(c.index is selfs[0].index for c in selfs)
    assert [c.advances for c in selfs] == [False, False, True]
    ids = torch.randint(3, 99, (2, 5))
    if preset == "tiny-decoder":
        model(ids[:, :4], caches=caches)
        assert int(selfs[0].index) == 4  # not 12: three layers advanced one position
        model(ids[:, 4:], caches=caches)
    else:
        memory = model.encode(torch.randint(3, 99, (2, 6)))
        model.decode(ids[:, :4], memory, caches=caches)
        assert int(selfs[0].index) == 4
        model.decode(ids[:, 4:], memory, caches=caches)
    assert int(selfs[0].index) == 5


def test_cached_steps_equal_the_whole_sequence_with_the_shared_position():
    model = build_model("tiny-decoder", attention="mha", **SMALL).double().eval()
    ids = torch.randint(3, 99, (2, 7))
    whole = model(ids).logits
    caches = model.new_caches(2, 12)
    steps = [model(ids[:, :4], caches=caches).logits] + [model(ids[:, t:t + 1], caches=caches).logits
                                                         for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=0, atol=1e-12)


def test_a_decode_step_writes_each_layers_keys_and_values_and_the_position_once():
    """One write a layer of the stacked keys and values, and one move of the shared position a
    step; the caches hold what the model's own whole-sequence keys would."""
    torch.manual_seed(0)
    model = build_model("tiny-decoder", attention="mha", **SMALL).double().eval()
    ids = torch.randint(3, 99, (1, 4))
    caches = model.new_caches(1, 10)
    model(ids, caches=caches)
    with OpCount() as count:
        model(ids[:, :1], caches=caches)
    writes = count.ops.get("index_copy_", 0) + count.ops.get("index_copy", 0)
    assert writes == SMALL["n_layers"]
    assert count.ops.get("add_", 0) == 1  # the shared position
    whole = model.new_caches(1, 10)
    model(torch.cat([ids, ids[:, :1]], 1), caches=whole)
    for a, b in zip(caches, whole):
        torch.testing.assert_close(a.kv, b.kv, rtol=0, atol=1e-12)
    assert caches[0].kv[:, :, :, :5].abs().min() > 0


def test_keys_and_values_are_views_of_one_buffer_written_together():
    cache = KVCache(2, 3, 6, 4, dtype=torch.float64)
    k, v = torch.randn(2, 3, 2, 4, dtype=torch.float64), torch.randn(2, 3, 2, 4, dtype=torch.float64)
    cache.update(k, v)
    cache.update(v, k)
    assert cache.k.data_ptr() == cache.kv.data_ptr() and cache.v.is_contiguous()
    assert torch.equal(cache.k[:, :, :4], torch.cat([k, v], 2)) and torch.equal(cache.v[:, :, :4], torch.cat([v, k], 2))
    assert not cache.k[:, :, 4:].any() and int(cache.index) == 4 and cache.nbytes() == 2 * 2 * 3 * 6 * 4 * 8


def test_moving_one_cache_moves_the_position_every_cache_reads():
    model = build_model("tiny-decoder", attention="mqa", **SMALL).eval()
    caches = model.new_caches(1, 8)
    caches[1].to("meta")
    assert caches[0].index.is_meta and caches[2].index.is_meta


def test_caches_that_would_write_at_different_positions_are_refused():
    import copy

    from mhe.errors import MheError

    model = build_model("tiny-decoder", attention="mqa", **SMALL).double().eval()
    ids = torch.randint(3, 99, (1, 4))
    caches = model.new_caches(1, 8)
    for bad in (caches[::-1], caches[:2] + caches[1:2], [copy.deepcopy(c) for c in caches]):
        with pytest.raises(MheError, match="not one model.new_caches"):
            model(ids, caches=bad)
    assert int(caches[0].index) == 0  # refused before anything was written
    own = [layer.self_attn.new_cache(1, 8, dtype=torch.float64) for layer in model.decoder.layers]  # each its own
    steps = [model(ids[:, :3], caches=own).logits, model(ids[:, 3:], caches=own).logits]
    torch.testing.assert_close(torch.cat(steps, 1), model(ids).logits, rtol=0, atol=1e-12)


def test_a_stacked_write_is_the_update_of_its_halves_and_checks_its_shape():
    """``write_stacked`` of ``[2, B, h, T, d]`` writes what ``update`` of its two halves writes and
    advances the position as far; a stack of other heads or too many tokens is refused by name."""
    from mhe.errors import MheError

    k, v = torch.randn(2, 3, 2, 4, dtype=torch.float64), torch.randn(2, 3, 2, 4, dtype=torch.float64)
    by_update, stacked = KVCache(2, 3, 6, 4, dtype=torch.float64), KVCache(2, 3, 6, 4, dtype=torch.float64)
    by_update.update(k, v)
    stacked.write_stacked(torch.stack((k, v)))
    assert torch.equal(stacked.kv, by_update.kv) and int(stacked.index) == int(by_update.index) == 2
    with pytest.raises(MheError, match=r"heads=3.*got keys of shape \(2, 4, 2, 4\)"):
        stacked.write_stacked(torch.zeros(2, 2, 4, 2, 4, dtype=torch.float64))
    with pytest.raises(MheError, match="overflow"):
        stacked.write_stacked(torch.zeros(2, 2, 3, 5, 4, dtype=torch.float64))
    with pytest.raises(MheError, match=r"\[2, B, heads, T, d\].*got \(3, 2, 3, 1, 4\)"):
        stacked.write_stacked(torch.zeros(3, 2, 3, 1, 4, dtype=torch.float64))
