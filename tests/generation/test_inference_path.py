"""The inference path's contract: the model makes the mask and the positions once per forward
and hands them to every layer; the projection hooks receive the tokens' absolute positions."""

import torch

from mhe.attention import AttentionMask
from mhe.models import build_model

SMALL = dict(vocab_size=99, d_model=32, n_heads=4, d_ff=64, n_layers=3, max_len=40, dropout=0.0, attn_dropout=0.0)


def record(model, layers, what):
    """Wrap each layer's attention hook ``what`` to record the positions it receives: (layer, the
    tensor, its value then; a decode step's inputs are reused, so the tensor changes later)."""
    seen = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn if what != "_cross" else layer.cross_attn
        hook = "_keys_values" if what == "_cross" else what
        original = getattr(attn, hook)

        def wrapped(x, positions, _i=i, _f=original):
            seen.append((_i, positions, None if positions is None else positions.clone()))
            return _f(x, positions)
        setattr(attn, hook, wrapped)
    return seen


def test_every_layer_gets_the_one_mask_of_its_forward():
    model = build_model("tiny-decoder", attention="mqa", **SMALL).double().eval()
    masks = []
    for layer in model.decoder.layers:
        forward = layer.self_attn.forward

        def wrapped(x, *, _f=forward, **kw):
            masks.append(kw["mask"])
            return _f(x, **kw)
        layer.self_attn.forward = wrapped
    ids = torch.randint(3, 99, (2, 5))
    pad = torch.ones(2, 5, dtype=torch.long)
    pad[1, :2] = 0
    caches = model.new_caches(2, 8)
    model(ids, attention_mask=pad)  # no cache, padded
    model(ids[:, :4], caches=caches)  # a prompt into a cache
    model(ids[:, 4:], caches=caches)  # one token
    assert len(masks) == 3 * 3
    for forward in range(3):
        built = masks[3 * forward:3 * forward + 3]
        assert isinstance(built[0], AttentionMask) and all(m is built[0] for m in built)
    assert masks[6].keys == 8 and masks[6].dense.shape == (1, 1, 1, 8)  # the cache's 8 positions


def test_hooks_receive_absolute_positions_skipping_left_padding():
    model = build_model("tiny-decoder", attention="mha", **SMALL).double().eval()  # decodes unfolded
    ids = torch.randint(3, 99, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[1, :2] = 0
    # generation computes Q, K and V in one product (fused_projections): the hook is _self_projections
    seen = record(model, model.decoder.layers, "_self_projections")
    model.generate(ids, 3, attention_mask=mask, step_mode="eager")
    want = [torch.tensor([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]]), torch.tensor([[5], [3]]), torch.tensor([[6], [4]])]
    got = [v for i, _, v in seen if i == 0]
    assert len(got) == 3 and all(torch.equal(g, w) for g, w in zip(got, want))
    for forward in range(3):  # every layer gets its forward's positions
        assert all(p is seen[3 * forward][1] for _, p, _ in seen[3 * forward:3 * forward + 3])


def test_cached_forward_positions_follow_the_cache_and_cross_keys_have_none():
    model = build_model("tiny-encoder-decoder", attention="mha", **SMALL).double().eval()
    own = record(model, model.decoder_layers[:1], "_queries")
    cross = record(model, model.decoder_layers[:1], "_cross")
    src, tgt = torch.randint(3, 99, (2, 6)), torch.randint(3, 99, (2, 4))
    memory = model.encode(src)
    caches = model.new_caches(2, 6)
    model.decode(tgt[:, :3], memory, caches=caches)
    model.decode(tgt[:, 3:], memory, caches=caches)
    assert [v.tolist() for _, _, v in own] == [[0, 1, 2], [3]]
    assert [p for _, p, _ in cross] == [None]  # the encoder's keys, computed once and stored
