"""Conversion of Llama-style decoders (rotary positions, RMSNorm, SwiGLU, grouped K/V): models
exactly of MHE form come back exactly for both rope orders, MHE-Add's offsets after the rotation
are the least-squares optimum on the rotated projections (a literal solve, and the model's own
activations), and mean pooling equals a hand computation (:mod:`mhe.convert.rotary`).

The models rotate the first half of each head (``rope_fraction=0.5``: 4 of 8 dimensions), so the
rotary pairs and the dimensions that pass through are both exercised."""

import pytest
import torch

from conftest import D_MODEL, N_HEADS, VOCAB
from mhe.attention.rotary import RotaryEmbedding
from mhe.convert import convert_model
from mhe.convert.heads import Heads
from mhe.convert.rotary import RotaryFit
from mhe.convert.stats import InputStats
from mhe.convert.sublayer import convert_sublayer
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


def test_mean_pooling_of_a_llama_source_equals_a_hand_computation():
    """K/V heads averaged within each group (queries, output kept), with or without alignment:
    under RoPE only values may be turned, so the keys are the plain means either way."""
    for src, kind, kv, groups in ((llama("mha", qkv_bias=True), "gqa", 2, [[0, 1], [2, 3]]),
                                  (llama("gqa", n_kv=2, qkv_bias=True), "mqa", 0, [[0, 1]])):
        for align in (False, True):
            conv, _ = convert_model(src, kind, n_kv_heads=kv, align=align)
            for layer in range(2):
                s, c = src.decoder.layers[layer].self_attn, conv.decoder.layers[layer].self_attn
                turned = ("v_proj", "out_proj") if align else ()  # values and outputs turn together
                for proj in ("k_proj", "v_proj"):
                    if proj in turned:
                        continue
                    w, b = getattr(s, proj).weight, getattr(s, proj).bias  # [h*d, m], [h*d]
                    hand_w = torch.cat([sum(w[h * D:(h + 1) * D] for h in grp) / len(grp) for grp in groups])
                    hand_b = torch.cat([sum(b[h * D:(h + 1) * D] for h in grp) / len(grp) for grp in groups])
                    assert gap(getattr(c, proj).weight, hand_w) < 1e-15 and gap(getattr(c, proj).bias, hand_b) < 1e-15
                for proj in ("q_proj", "out_proj"):
                    if proj not in turned:
                        assert torch.equal(getattr(c, proj).weight, getattr(s, proj).weight)


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
