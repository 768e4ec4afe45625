"""Conversion of Llama-style decoders (rotary positions, RMSNorm, SwiGLU, grouped K/V): models
exactly of MHE form come back exactly for both rope orders, MHE-Add's offsets after the rotation
are the least-squares optimum on the rotated projections (a literal solve, and the model's own
activations), mean pooling equals a hand computation (:mod:`mhe.convert.rotary`), and query/key
alignment keeps to the rotations that commute with RoPE: they leave the model unchanged (others
do not), heads that differ only by such rotations merge exactly, and the aligned error is never
above the unaligned one.

The models rotate the first half of each head (``rope_fraction=0.5``: 4 of 8 dimensions), so the
rotary pairs and the dimensions that pass through are both exercised."""

import copy
from dataclasses import replace
from functools import partial

import pytest
import torch

from conftest import D_MODEL, N_HEADS, VOCAB
from mhe.attention.rotary import RotaryEmbedding
from mhe.convert import convert_model, input_stats
from mhe.convert.fit import rotary_procrustes
from mhe.convert.heads import ROLES, Heads, linear_state, out_state, read_heads
from mhe.convert.rotary import RotaryFit
from mhe.convert.stats import InputStats
from mhe.convert.sublayer import _rotation, convert_sublayer
from mhe.convert.targets import fit_target
from mhe.models import build_model

D = D_MODEL // N_HEADS  # 8
HALF = 2  # rope_fraction 0.5: pairs (0, 2), (1, 3); dimensions 4..7 unrotated
TOL = 1e-10


def llama(kind="mha", *, n_kv=0, qkv_bias=False, **opts):
    options = {"n_kv_heads": n_kv} if kind == "gqa" else (opts or None)
    model = build_model("llama-tiny", attention=kind, d_model=D_MODEL, n_heads=N_HEADS, n_layers=2, d_ff=48,
                        vocab_size=VOCAB, max_len=16, attn_options=options, qkv_bias=qkv_bias, rope_fraction=0.5)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # every weight random and O(1) logits, so no part can go unnoticed
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return model.double().eval()


def ids(seed=0, b=2, t=7):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def gap(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def logits(model, x=None):
    with torch.no_grad():
        return model(ids() if x is None else x).logits


def embeddings(mhe, *, kv=N_HEADS, pairs=True, std=0.5):
    """Random head embeddings far from zero; K/V ones equal within each of ``kv`` groups (a GQA
    source can hold them) and, with ``pairs``, query/key ones equal within each rotary pair."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in mhe.decoder.layers:
            e = layer.self_attn.head_embed  # [3, n, d]
            e.copy_(std * torch.randn(e.shape, generator=g, dtype=e.dtype))
            e[1:] = e[1:, ::N_HEADS // kv].repeat_interleave(N_HEADS // kv, dim=1)
            if pairs:
                e[:2, :, HALF:2 * HALF] = e[:2, :, :HALF]
    return mhe


def per_head_source(mhe, kv=N_HEADS):
    """The Llama MHA (``kv`` = n) or GQA model whose heads are the MHE model's, head by head:
    W^r diag(1 + e^r_i) with bias b^r (1 + e^r_i) (Mul), or W^r with bias b^r + e^r_i (Add)."""
    add = not mhe.decoder.layers[0].self_attn.multiplicative
    src = llama("mha" if kv == N_HEADS else "gqa", n_kv=0 if kv == N_HEADS else kv, qkv_bias=add or mhe.cfg.qkv_bias)
    state = {k: v for k, v in mhe.state_dict().items() if "self_attn" not in k}
    for i, layer in enumerate(mhe.decoder.layers):
        a, p = layer.self_attn, f"decoder.layers.{i}.self_attn."
        for j, r in enumerate("qkv"):
            lin, heads = getattr(a, f"{r}_proj"), N_HEADS if r == "q" else kv
            e = a.head_embed[j, ::N_HEADS // heads]  # [heads, d]: one per group
            bias = lin.bias if lin.bias is not None else torch.zeros(D, dtype=lin.weight.dtype)
            w = [lin.weight * (1 + e[h])[:, None] if not add else lin.weight for h in range(heads)]
            state[p + f"{r}_proj.weight"] = torch.cat(w)
            if add or mhe.cfg.qkv_bias:
                state[p + f"{r}_proj.bias"] = torch.cat([bias + e[h] if add else bias * (1 + e[h]) for h in range(heads)])
        state[p + "out_proj.weight"] = a.out_proj.weight
    src.load_state_dict(state, strict=True)
    return src


@pytest.mark.parametrize("kv", [N_HEADS, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("align", [False, True])
def test_a_llama_model_exactly_of_mhe_mul_form_converts_back_exactly(kv, qkv_bias, align):
    mhe = embeddings(llama("mhe-mul", qkv_bias=qkv_bias), kv=kv)
    src = per_head_source(mhe, kv)
    assert gap(logits(src), logits(mhe)) < TOL  # the source is the MHE model
    conv, report = convert_model(src, "mhe-mul", align=align)
    assert conv.cfg.attn_options.rope_order == "rope-then-psi"  # the default, said explicitly
    assert report.options["attn_options"]["rope_order"] == "rope-then-psi" and report.options["cache_heads"] == 1
    assert "rope_order=rope-then-psi" in report.options["rotary"]
    assert gap(logits(conv), logits(mhe)) < TOL
    for layer in conv.decoder.layers:  # the scales found are shared within every rotary pair
        e = layer.self_attn.head_embed
        assert torch.equal(e[:2, :, HALF:2 * HALF], e[:2, :, :HALF])


def test_psi_then_rope_is_fitted_with_free_scales():
    """Under psi-then-rope a head is R_t(W x * s_i) = R_t(W diag(s_i) x), so a source of that form
    with scales that differ within the rotary pairs comes back exactly when that order is asked
    for, and not under rope-then-psi, whose pair-shared scales cannot express it."""
    mhe = embeddings(llama("mhe-mul", qkv_bias=True, rope_order="psi-then-rope"), pairs=False)
    src = per_head_source(mhe)
    assert gap(logits(src), logits(mhe)) < TOL
    conv, report = convert_model(src, "mhe-mul", options={"rope_order": "psi-then-rope"})
    assert conv.cfg.attn_options.rope_order == "psi-then-rope" and report.options["cache_heads"] == N_HEADS
    assert gap(logits(conv), logits(mhe)) < TOL
    paired, report = convert_model(src, "mhe-mul")
    assert gap(logits(paired), logits(mhe)) > 1e-3
    assert min(errs["q"]["weight"][0] for _, errs in report.layers) > 1e-2


def test_mhe_add_psi_then_rope_converts_back_exactly():
    """Offsets before the rotation are per-head biases: a source of that form comes back exactly,
    its key offsets (which no longer cancel in softmax) included."""
    mhe = embeddings(llama("mhe-add", rope_order="psi-then-rope"), pairs=False)
    src = per_head_source(mhe)
    assert gap(logits(src), logits(mhe)) < TOL
    conv, _ = convert_model(src, "mhe-add", options={"rope_order": "psi-then-rope"}, calibration=[ids(1, 4, 16)])
    assert gap(logits(conv), logits(mhe)) < TOL


def _rotate(y, pos, rope):
    """``y`` [N, d] rotated at positions ``pos`` [N] by ``rope`` (the model's own table)."""
    return rope(y[:, None, None, :], pos[:, None])[:, 0, 0]  # [N, 1, 1, d] at [N, 1] positions


def test_mhe_add_rotated_offsets_are_the_literal_least_squares_solution():
    """min over W (shared, bias row included) and c_i of sum_i sum_t ||R_t A_i^T x~_t - R_t W^T x~_t -
    c_i||^2: the outputs are linear in (W, c), so the literal best outputs are one least-squares solve
    over the operator's columns (unique, though on the unrotated dimensions W's bias row and c trade
    off); the fit's outputs must equal them (its offsets act after the rotation)."""
    g = torch.Generator().manual_seed(3)
    n, m, big = 3, 6, 40
    a = torch.randn(n, m + 1, D, generator=g, dtype=torch.float64)
    x = torch.randn(big, m, generator=g, dtype=torch.float64) + 0.7
    xt = torch.cat([x, torch.ones(big, 1, dtype=x.dtype)], 1)  # [N, p]
    pos = torch.randint(0, 16, (big,), generator=g)
    rope = RotaryEmbedding(D, fraction=0.5, max_len=16)
    cos, sin = (t[:, :HALF][pos].double() for t in rope.table(torch.device("cpu")))  # [N, r/2]
    stats = InputStats(mean=x.mean(0), second=x.T @ x / big, count=big, cos_mean=cos.T @ xt / big,
                       sin_mean=sin.T @ xt / big)
    h = Heads(q=a, k=a.flip(0), v=a, out=torch.randn(n, m, D, generator=g, dtype=torch.float64), out_bias=None,
              kv_heads=n, bias=True)
    res = convert_sublayer(h, "mhe-add", stats=stats, rotary=RotaryFit(D, 2 * HALF, "rope-then-psi"))

    def residual_map(theta):  # (W [p, d], c [n, d]) -> the fitted outputs [n, N, d]
        w, c = theta[:(m + 1) * D].view(m + 1, D), theta[(m + 1) * D:].view(n, D)
        return _rotate(xt @ w, pos, rope)[None] + c[:, None]

    unknowns = (m + 1) * D + n * D
    op = torch.stack([residual_map(col).reshape(-1) for col in torch.eye(unknowns, dtype=torch.float64)], 1)
    target = torch.stack([_rotate(xt @ a[i], pos, rope) for i in range(n)]).reshape(-1)
    # the best outputs (unique); gelsd (SVD), as the operator is rank-deficient by construction
    literal = op @ torch.linalg.lstsq(op, target[:, None], driver="gelsd").solution[:, 0]
    st = res.state
    w_fit = torch.cat([st["q_proj.weight"].T, st["q_proj.bias"][None]])  # [p, d]
    fitted_out = residual_map(torch.cat([w_fit.reshape(-1), st["head_embed"][0].reshape(-1)])).reshape(-1)
    assert gap(fitted_out, literal) < TOL
    normal = op.T @ (target - fitted_out)  # the normal equations: the residual is orthogonal to every direction
    assert normal.norm() < 1e-12 * op.norm() * target.norm()
    assert gap(w_fit[:, :2 * HALF], a.mean(0)[:, :2 * HALF]) < 1e-14  # W: the mean of the heads
    direct = (fitted_out - target).norm() / target.norm()
    assert res.errors["q"]["output"][0] == pytest.approx(float(direct), rel=1e-9)  # the reported error is exact


def _attention_inputs(model, x):
    """(input, positions) of every attention sublayer in a forward of ``x``."""
    seen = []
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda _m, args, kw: seen.append((args[0], kw.get("positions"))), with_kwargs=True)
        for layer in model.decoder.layers]
    logits(model, x)
    for hk in hooks:
        hk.remove()
    return seen


@torch.no_grad()
def test_mhe_add_offsets_zero_the_mean_rotated_residual_of_the_model():
    """On the model's own activations over the calibration batch: the converted queries (shared
    projection rotated, then the offsets) miss the source's by a residual whose mean is zero per
    head and dimension (the optimality condition of each offset), the reported output error is
    the measured one, and offsets fitted as if before the rotation do worse."""
    src = llama("mha", qkv_bias=True)
    x = ids(1, 4, 16)
    conv, report = convert_model(src, "mhe-add", calibration=[x], align=False)
    for i, (inp, pos) in enumerate(_attention_inputs(src, x)):
        s_att, c_att = src.decoder.layers[i].self_attn, conv.decoder.layers[i].self_attn
        q_src, q_conv = s_att._queries(inp, pos), c_att._queries(inp, pos)  # [B, n, T, d]
        resid = q_src - q_conv
        assert resid.mean((0, 2)).abs().max() < 1e-12 * q_src.abs().max()
        measured = float(resid.norm() / q_src.norm())
        assert report.layers[i][1]["q"]["output"][0] == pytest.approx(measured, rel=1e-9)
        e_rot = c_att.head_embed[0]  # [n, d]
        xbar = torch.cat([inp.flatten(0, 1).mean(0), torch.ones(1, dtype=inp.dtype)])
        heads = torch.cat([s_att.q_proj.weight.T, s_att.q_proj.bias[None]]).view(-1, N_HEADS, D)  # [p, n, d]
        e_plain = torch.einsum("p,pnd->nd", xbar, heads - heads.mean(1, keepdim=True))
        unrotated = q_conv + (e_plain - e_rot)[None, :, None, :]
        assert float((q_src - unrotated).norm() / q_src.norm()) > measured + 1e-3


def _head(lin, h):
    """Head ``h`` of a projection in the paper's orientation, bias row last: ``[m+1, d]``."""
    return torch.cat([lin.weight[h * D:(h + 1) * D].T, lin.bias[h * D:(h + 1) * D][None]]).detach()


def _assert_commutes_with_rope(r):
    """``r`` ``[d, d]``: a plane rotation (det +1) on each rotary pair (j, j + r/2), an orthogonal
    block on the unrotated dimensions, zero elsewhere."""
    blocks = torch.zeros(D, D, dtype=torch.bool)
    for j in range(HALF):
        blocks[j, j] = blocks[j, j + HALF] = blocks[j + HALF, j] = blocks[j + HALF, j + HALF] = True
    blocks[2 * HALF:, 2 * HALF:] = True
    assert r[~blocks].abs().max() < 1e-12
    for j in range(HALF):
        c, s = r[j, j], r[j + HALF, j]
        assert torch.allclose(r[[j, j, j + HALF], [j + HALF, j, j + HALF]], torch.stack([-s, c, c]), atol=1e-12)
        assert abs(float(c * c + s * s) - 1) < 1e-12
    rest = r[2 * HALF:, 2 * HALF:]
    assert gap(rest @ rest.T, torch.eye(D - 2 * HALF, dtype=r.dtype)) < 1e-12


def test_mean_pooling_of_a_llama_source_equals_a_hand_computation():
    """K/V heads averaged within each group (queries, output kept). With alignment every source
    K/V head's queries and keys are first turned by one rotation that commutes with RoPE (read back
    from the converted queries), and the keys are the means of the turned heads."""
    for src, kind, kv, groups in ((llama("mha", qkv_bias=True), "gqa", 2, [[0, 1], [2, 3]]),
                                  (llama("gqa", n_kv=2, qkv_bias=True), "mqa", 0, [[0, 1]])):
        per_unit = N_HEADS // src.decoder.layers[0].self_attn.n_kv_heads  # query heads per source K/V head
        for align in (False, True):
            conv, _ = convert_model(src, kind, n_kv_heads=kv, align=align)
            for layer in range(2):
                s, c = src.decoder.layers[layer].self_attn, conv.decoder.layers[layer].self_attn
                eye = torch.eye(D, dtype=torch.float64)
                turns = [torch.linalg.lstsq(_head(s.q_proj, h), _head(c.q_proj, h)).solution if align else eye
                         for h in range(N_HEADS)]
                for h, r in enumerate(turns):
                    if align:
                        _assert_commutes_with_rope(r)
                        assert gap(_head(s.q_proj, h) @ r, _head(c.q_proj, h)) < 1e-12
                    else:
                        assert torch.equal(_head(c.q_proj, h), _head(s.q_proj, h))
                assert (max(gap(r, eye) for r in turns) > 1e-2) == align  # alignment turns queries and keys
                # groups: source K/V heads; K/V head u serves query heads u * per_unit ...
                hand = torch.stack([sum(_head(s.k_proj, u) @ turns[u * per_unit] for u in grp) / len(grp)
                                    for grp in groups])
                keys = torch.stack([_head(c.k_proj, g) for g in range(len(groups))])
                assert gap(keys, hand) < (1e-12 if align else 1e-15)
                if not align:  # values: the plain means (aligned, they turn with the output projection)
                    hand_v = torch.stack([sum(_head(s.v_proj, u) for u in grp) / len(grp) for grp in groups])
                    assert gap(torch.stack([_head(c.v_proj, g) for g in range(len(groups))]), hand_v) < 1e-15
                    assert torch.equal(c.out_proj.weight, s.out_proj.weight)


def test_a_gqa_llama_source_regrouped_is_the_same_model():
    gqa = llama("gqa", n_kv=2, qkv_bias=True)
    for kv in (2, 4):  # its own groups, and every query head its own copy
        conv, _ = convert_model(gqa, "gqa", n_kv_heads=kv)
        assert gap(logits(conv), logits(gqa)) < TOL


def test_a_llama_source_of_single_head_form_converts_to_sha_exactly():
    """Heads that all project alike attend alike; their summed outputs are what SHA computes."""
    src = llama("mha", qkv_bias=True)
    with torch.no_grad():
        for layer in src.decoder.layers:
            for proj in ("q_proj", "k_proj", "v_proj"):
                lin = getattr(layer.self_attn, proj)
                lin.weight.copy_(lin.weight[:D].repeat(N_HEADS, 1))
                lin.bias.copy_(lin.bias[:D].repeat(N_HEADS))
    conv, _ = convert_model(src, "sha")
    assert gap(logits(conv), logits(src)) < TOL


def _rope_rotations(g, units):
    """Random rotations that commute with RoPE ``[units, d, d]``, built by hand: a plane rotation
    by a random angle on each rotary pair (j, j + r/2), a random orthogonal block on the rest."""
    r = torch.zeros(units, D, D, dtype=torch.float64)
    angle = 2 * torch.pi * torch.rand(units, HALF, generator=g, dtype=torch.float64)
    for j in range(HALF):
        c, s = angle[:, j].cos(), angle[:, j].sin()
        r[:, j, j], r[:, j, j + HALF], r[:, j + HALF, j], r[:, j + HALF, j + HALF] = c, -s, s, c
    r[:, 2 * HALF:, 2 * HALF:] = _orthogonal(g, units, D - 2 * HALF)
    return r


def _orthogonal(g, units, d):
    q, _ = torch.linalg.qr(torch.randn(units, d, d, generator=g, dtype=torch.float64))
    return q


def _with_heads(model, heads_of):
    """A copy of the MHA ``model`` whose every attention sublayer's heads are ``heads_of(heads)``."""
    out = copy.deepcopy(model)
    for layer in out.decoder.layers:
        a = layer.self_attn
        h = heads_of(read_heads(a.state_dict(), n_heads=N_HEADS, head_dim=D))
        state = {k: v for r in ROLES for k, v in linear_state(f"{r}_proj", h.role(r), h.bias).items()}
        a.load_state_dict({**state, **out_state(h.out, h.out_bias)}, strict=True)
    return out


def test_rotations_within_rotary_pairs_keep_the_model_and_others_do_not():
    """Turning every head's query and key columns by one rotation that commutes with RoPE (and its
    value and output columns by any rotation) leaves the model's logits unchanged; a general
    rotation, or a reflection within a rotary pair, changes them. So does what
    :func:`rotary_procrustes` returns for a random target."""
    src, g = llama("mha", qkv_bias=True), torch.Generator().manual_seed(5)
    block, any_v = _rope_rotations(g, N_HEADS), _orthogonal(g, N_HEADS, D)
    solved = rotary_procrustes(torch.randn(N_HEADS, D, D, generator=g, dtype=torch.float64), 2 * HALF)
    reflected = block.clone()
    reflected[:, :, HALF] *= -1  # det -1 within the first pair: commutes with no rotation by a nonzero angle
    for r_qk, keeps in ((block, True), (solved, True), (_orthogonal(g, N_HEADS, D), False), (reflected, False)):
        turned = _with_heads(src, lambda h, r=r_qk: h.rotated(r, any_v))
        q_turned, q_src = (m.decoder.layers[0].self_attn.q_proj.weight for m in (turned, src))
        assert gap(q_turned, q_src) > 0.1
        assert (gap(logits(turned), logits(src)) < 1e-12) if keeps else (gap(logits(turned), logits(src)) > 1e-2)


def _planted(src, g):
    """``src`` with heads W B_i: one W per role and layer (head 0's), B_i a rotation that commutes
    with RoPE shared by head i's query and key, any rotation of its values (output blocks along)."""
    def plant(h):
        b, c = _rope_rotations(g, N_HEADS), _orthogonal(g, N_HEADS, D)
        w = {r: h.role(r)[:1].expand(N_HEADS, -1, -1) for r in ROLES}  # [n, p, d]
        return replace(h, q=w["q"] @ b, k=w["k"] @ b, v=w["v"] @ c, out=h.out @ c)
    return _with_heads(src, plant)


@pytest.mark.parametrize("kind", ["mqa", "gqa", "mhe-mul"])
def test_heads_that_differ_by_rotations_within_rotary_pairs_merge_exactly(kind):
    """Planted: every head is W B_i with B_i a rotation that commutes with RoPE, a form every target
    holds once each head is turned back. Aligned, the conversion finds the turns and is the source
    model; without alignment the keys are far from it."""
    src = _planted(llama("mha", qkv_bias=True), torch.Generator().manual_seed(6))
    ref = logits(src)
    conv, report = convert_model(src, kind, n_kv_heads=2 if kind == "gqa" else 0, align=True)
    assert gap(logits(conv), ref) < 1e-12
    if kind != "mhe-mul":
        assert report.options["rotary"].endswith("queries and keys are aligned only by rotations that commute with RoPE")
    plain, base = convert_model(src, kind, n_kv_heads=2 if kind == "gqa" else 0, align=False)
    assert gap(logits(plain), ref) > 1e-2
    for (_, errs), (_, errs0) in zip(report.layers, base.layers):
        for role in ("k", "qk", "v"):
            assert errs[role]["weight"][0] < 1e-12 and errs0[role]["weight"][0] > 0.1, (role, errs, errs0)


def _objective(res, h, stats, roles, space):
    """The fit's squared error summed over ``roles`` (relative errors times the heads' norms, which
    no rotation changes): what one Procrustes step over these roles minimises."""
    gram = stats.gram() if space == "output" else None
    return sum(res.errors[r][space][0] ** 2 * float(torch.einsum("npd,npd->", h.role(r), h.role(r)) if gram is None
                                                   else torch.einsum("npd,pq,nqd->", h.role(r), gram, h.role(r)))
               for r in roles)


@pytest.mark.parametrize("kind, order", [("mqa", ""), ("gqa", ""), ("mhe-mul", "rope-then-psi"),
                                         ("mhe-mul", "psi-then-rope"), ("mhe-add", "rope-then-psi"),
                                         ("mhe-add", "psi-then-rope")])
def test_rope_alignment_never_raises_the_error_and_turns_queries_and_keys(kind, order):
    """On a random Llama source with calibration inputs, the aligned fit's objective (queries and
    keys together, values apart) is never above the unaligned one, and for queries/keys it is
    strictly lower: they are aligned too, within the rotations that commute with RoPE."""
    src = llama("mha", qkv_bias=True)
    prefix = "decoder.layers.1.self_attn"
    stats = input_stats(src, [ids(1, 4, 16)])[prefix]
    h = read_heads(src.decoder.layers[1].self_attn.state_dict(), n_heads=N_HEADS, head_dim=D)
    rotary = RotaryFit(D, 2 * HALF, order)
    space = "output" if kind == "mhe-add" else "weight"
    plain, aligned = (convert_sublayer(h, kind, kv_heads=2, stats=stats, rotary=rotary, align=a) for a in (False, True))
    for roles in (("q", "k"), ("v",)):
        before, after = _objective(plain, h, stats, roles, space), _objective(aligned, h, stats, roles, space)
        assert after <= before * (1 + 1e-12)
        assert after < 0.95 * before, (roles, after, before)


def _literal_add_objective(h, w, rot, xt, pos, rope):
    """MHE-Add's query+key objective with offsets after RoPE, by brute force over the tokens: head i
    turned by ``rot[i]``, the shared projection ``w[r]``, the best offset (the residual's mean)."""
    total = 0.0
    for r in ("q", "k"):
        for i in range(N_HEADS):
            resid = _rotate(xt @ (h.role(r)[i] @ rot[i]), pos, rope) - _rotate(xt @ w[r], pos, rope)  # [N, d]
            total += float((resid - resid.mean(0)).pow(2).sum())
    return total


def test_mhe_add_rope_then_psi_alignment_step_is_the_literal_optimum():
    """With the shared projection fixed and the offsets after RoPE re-fitted for every rotation, the
    Procrustes step's rotation is the best that commutes with RoPE: the literal objective over the
    tokens rises when it is nudged by any small rotation within a rotary pair or of the rest."""
    g = torch.Generator().manual_seed(8)
    m, big = 6, 60
    x = torch.randn(big, m, generator=g, dtype=torch.float64) + 0.7
    xt = torch.cat([x, torch.ones(big, 1, dtype=x.dtype)], 1)
    pos = torch.randint(0, 16, (big,), generator=g)
    rope = RotaryEmbedding(D, fraction=0.5, max_len=16)
    cos, sin = (t[:, :HALF][pos].double() for t in rope.table(torch.device("cpu")))
    stats = InputStats(mean=x.mean(0), second=x.T @ x / big, count=big, cos_mean=cos.T @ xt / big,
                       sin_mean=sin.T @ xt / big)
    a = lambda: torch.randn(N_HEADS, m + 1, D, generator=g, dtype=torch.float64)  # noqa: E731
    h = Heads(q=a(), k=a(), v=a(), out=a()[:, :m], out_bias=None, kv_heads=N_HEADS, bias=True)
    f = fit_target(h, "mhe-add", stats=stats, rotary=RotaryFit(D, 2 * HALF, "rope-then-psi"))
    assert set(f.rotated_offsets) == {"q", "k"}
    w = {r: h.role(r).mean(0) for r in ("q", "k")}  # the fit's shared projections: the means
    eye = torch.eye(D, dtype=torch.float64).expand(N_HEADS, D, D)
    best = _rotation(h, f, ("q", "k"), stats, eye, partial(rotary_procrustes, width=2 * HALF))
    _assert_commutes_with_rope(best[0])
    at_best = _literal_add_objective(h, w, best, xt, pos, rope)
    assert at_best < 0.9 * _literal_add_objective(h, w, eye, xt, pos, rope)
    nudges = []
    for j in range(HALF):
        for eps in (1e-3, -1e-3):
            n = torch.eye(D, dtype=torch.float64)
            n[j, j] = n[j + HALF, j + HALF] = torch.cos(torch.tensor(eps, dtype=torch.float64))
            n[j, j + HALF], n[j + HALF, j] = -torch.sin(torch.tensor(eps)), torch.sin(torch.tensor(eps))
            nudges.append(n)
    for _ in range(6):
        skew = torch.zeros(D, D, dtype=torch.float64)
        k = 1e-3 * torch.randn(D - 2 * HALF, D - 2 * HALF, generator=g, dtype=torch.float64)
        skew[2 * HALF:, 2 * HALF:] = k - k.T
        nudges.append(torch.linalg.matrix_exp(skew))
    for n in nudges:
        for i in range(N_HEADS):  # one head at a time: the objective splits over the heads
            rot = best.clone()
            rot[i] = best[i] @ n
            assert at_best <= _literal_add_objective(h, w, rot, xt, pos, rope) * (1 + 1e-13)
