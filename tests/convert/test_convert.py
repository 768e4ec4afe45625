"""The conversion's fits (``mhe.convert``): mean pooling by hand, exact recovery of models that
are exactly of MHE form, each fit against a literal least-squares solution, and the fit never
worse than the naive initialisation (mean of the heads, head embeddings zero)."""

import pytest
import torch

from conftest import D_MODEL, N_HEADS, VOCAB
from mhe.convert import convert_model, input_stats
from mhe.convert.fit import procrustes, rank1_scales
from mhe.convert.heads import read_heads
from mhe.convert.sublayer import convert_sublayer
from mhe.errors import MheError
from mhe.models import build_model

D = D_MODEL // N_HEADS
TOL = 1e-10


def tiny(kind="mha", *, bias=True, n_kv=0, arch="decoder", **kw):
    preset = "tiny-decoder" if arch == "decoder" else "tiny-encoder"
    opts = {"n_kv_heads": n_kv} if kind == "gqa" else None
    cfg = dict(d_model=D_MODEL, n_heads=N_HEADS, n_layers=2, d_ff=64, vocab_size=VOCAB, max_len=16,
               dropout=0.0, attn_dropout=0.0, attn_bias=bias, attention=kind, attn_options=opts, **kw)
    return build_model(preset, **cfg).double().eval()


def ids(seed=0, b=2, t=7):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def gap(a, b):
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max())


def randomise(model, std=0.3):
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model


def test_mean_pooling_equals_a_hand_computation():
    mha = randomise(tiny("mha"))
    for kind, groups in (("mqa", [[0, 1, 2, 3]]), ("gqa", [[0, 1], [2, 3]])):
        conv, _ = convert_model(mha, kind, n_kv_heads=2 if kind == "gqa" else 0, align=False)  # Ainslie et al.
        for layer in range(2):
            src, dst = mha.decoder.layers[layer].self_attn, conv.decoder.layers[layer].self_attn
            for proj in ("k_proj", "v_proj"):
                w, b = getattr(src, proj).weight, getattr(src, proj).bias  # [n*d, m], [n*d]
                hand_w = torch.cat([sum(w[h * D:(h + 1) * D] for h in g) / len(g) for g in groups])
                hand_b = torch.cat([sum(b[h * D:(h + 1) * D] for h in g) / len(g) for g in groups])
                assert gap(getattr(dst, proj).weight, hand_w) < 1e-15
                assert gap(getattr(dst, proj).bias, hand_b) < 1e-15
            for proj in ("q_proj", "out_proj"):  # kept as they are
                assert torch.equal(getattr(dst, proj).weight, getattr(src, proj).weight)


def test_a_gqa_source_pools_its_groups_weighted_by_their_query_heads():
    gqa = tiny("gqa", n_kv=2)
    mqa, _ = convert_model(gqa, "mqa", align=False)
    w = gqa.decoder.layers[0].self_attn.k_proj.weight  # [2*d, m]
    assert gap(mqa.decoder.layers[0].self_attn.k_proj.weight, (w[:D] + w[D:]) / 2) < 1e-15
    again, _ = convert_model(gqa, "gqa", n_kv_heads=4, align=False)  # more groups than the source: exact copies
    assert gap(logits(again, ids()), logits(gqa, ids())) < TOL


def _mha_from_mhe(mhe):
    """The MHA model whose heads are exactly the MHE model's effective heads (reference path):
    head i of role r is W^r diag(1 + e^r_i) (Mul) or W^r with bias b^r + e^r_i (Add)."""
    mha = tiny("mha", bias=True)
    state = {k: v for k, v in mhe.state_dict().items() if "self_attn" not in k}
    n = N_HEADS
    for i, layer in enumerate(mhe.decoder.layers):
        a, p = layer.self_attn, f"decoder.layers.{i}.self_attn."
        for j, r in enumerate("qkv"):
            lin, e = getattr(a, f"{r}_proj"), a.head_embed[j]  # [d, m], [n, d]
            bias = lin.bias if lin.bias is not None else torch.zeros(D, dtype=lin.weight.dtype)
            if a.multiplicative:
                state[p + f"{r}_proj.weight"] = torch.cat([lin.weight * (1 + e[h])[:, None] for h in range(n)])
                state[p + f"{r}_proj.bias"] = torch.cat([bias * (1 + e[h]) for h in range(n)])
            else:
                state[p + f"{r}_proj.weight"] = lin.weight.repeat(n, 1)
                state[p + f"{r}_proj.bias"] = torch.cat([bias + e[h] for h in range(n)])
        state[p + "out_proj.weight"], state[p + "out_proj.bias"] = a.out_proj.weight, a.out_proj.bias
    mha.load_state_dict(state)
    return mha


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
@pytest.mark.parametrize("align", [False, True])
def test_a_model_exactly_of_mhe_form_converts_back_exactly(kind, align):
    mhe = tiny(kind, bias=True)
    with torch.no_grad():
        for layer in mhe.decoder.layers:
            layer.self_attn.head_embed.normal_(0, 0.5)  # far from zero: heads clearly apart
    mha = _mha_from_mhe(mhe)
    x = ids()
    assert gap(logits(mha, x), logits(mhe, x)) < TOL  # the MHA model is the MHE model
    calibration = [ids(1, 4, 16)] if kind == "mhe-add" else None
    conv, report = convert_model(mha, kind, calibration=calibration, align=align)
    assert conv.cfg.attention == kind
    assert gap(logits(conv, x), logits(mhe, x)) < TOL
    for _, errs in report.layers:
        for e in errs.values():
            assert e["weight"][0] < 1e-12 if kind == "mhe-mul" else e["output"][0] < 1e-12


def _heads(seed=0, n=N_HEADS, m=D_MODEL, bias=True):
    g = torch.Generator().manual_seed(seed)
    state = {f"{r}_proj.weight": torch.randn(n * D, m, generator=g, dtype=torch.float64) for r in "qkv"}
    state["out_proj.weight"] = torch.randn(m, n * D, generator=g, dtype=torch.float64)
    if bias:
        state.update({f"{r}_proj.bias": torch.randn(n * D, generator=g, dtype=torch.float64) for r in "qkvo"[:3]})
    return read_heads(state, n_heads=n, head_dim=D)


def _mul_objective(a, w, s):
    return float((a - w[None] * s[:, None, :]).pow(2).sum())


def test_rank1_fit_is_the_least_squares_optimum():
    a = _heads().q  # [n, p, d], random
    w, s = rank1_scales(a)
    best = _mul_objective(a, w, s)
    assert torch.allclose(s.pow(2).mean(0), torch.ones(D, dtype=s.dtype))  # root mean square one per column
    assert (s.sum(0) >= 0).all()
    # a stationary point of the objective ...
    w_, s_ = w.clone().requires_grad_(), s.clone().requires_grad_()
    (a - w_[None] * s_[:, None, :]).pow(2).sum().backward()
    assert w_.grad.abs().max() < 1e-9 and s_.grad.abs().max() < 1e-9
    # ... that alternating least squares from random starts never beats
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        s2 = torch.randn(N_HEADS, D, generator=g, dtype=torch.float64)
        for _ in range(300):
            w2 = (a * s2[:, None, :]).sum(0) / s2.pow(2).sum(0)  # best W given s, column by column
            s2 = (a * w2[None]).sum(1) / w2.pow(2).sum(0)  # best s given W
        assert _mul_objective(a, w2, s2) >= best - 1e-9
    assert best < _mul_objective(a, a.mean(0), torch.ones_like(s))  # and beats the mean of the heads


def test_rank1_groups_share_one_scale():
    a = _heads().q
    groups = [[j, j + D // 2] for j in range(D // 2)]
    w, s = rank1_scales(a, groups)
    for j, k in groups:
        assert torch.equal(s[:, j], s[:, k])
    free = _mul_objective(a, *rank1_scales(a))
    assert free <= _mul_objective(a, w, s)  # a constraint can only cost


def test_mhe_add_fit_is_the_least_squares_optimum_on_calibration_outputs():
    """min over W, b, e_i of sum_i ||X W_i + 1 b_i - (X W + 1 (b + e_i))||^2, solved literally."""
    h = _heads(seed=1, m=6, n=3)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 6, generator=g, dtype=torch.float64) + 0.7  # a non-zero mean
    xt = torch.cat([x, torch.ones(40, 1, dtype=x.dtype)], 1)
    stats = input_stats_of(x)
    res = convert_sublayer(h, "mhe-add", stats=stats)
    w, b, e = res.state["q_proj.weight"].T, res.state["q_proj.bias"], res.state["head_embed"][0]
    fitted = [x @ w + b + e[i] for i in range(3)]
    # the literal problem: unknowns W (m x d), and c_i = b + e_i per head; one lstsq per column
    target = torch.cat([xt @ h.q[i] for i in range(3)])  # [3N, d]
    design = torch.zeros(120, 6 + 3, dtype=x.dtype)
    for i in range(3):
        design[i * 40:(i + 1) * 40, :6] = x
        design[i * 40:(i + 1) * 40, 6 + i] = 1.0
    sol = torch.linalg.lstsq(design, target).solution
    literal = [x @ sol[:6] + sol[6 + i] for i in range(3)]
    for f, lit in zip(fitted, literal):
        assert gap(f, lit) < 1e-12


def input_stats_of(x):
    from mhe.convert.stats import InputStats

    return InputStats(mean=x.mean(0), second=x.T @ x / x.shape[0], count=x.shape[0])


# what each fit minimises exactly: (space, roles) -- the errors that can never exceed the naive ones
MINIMISED = {"mhe-mul": ("weight", ("q", "k", "v")), "mhe-add": ("output", ("q", "k", "v")),
             "mqa": ("weight", ("k", "v")), "gqa": ("weight", ("k", "v")), "sha": ("weight", ("qk", "vo"))}


@pytest.mark.parametrize("align", [False, True])
@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add", "mqa", "gqa", "sha"])
def test_the_fit_is_never_worse_than_the_naive_initialisation(kind, align):
    mha = randomise(tiny("mha"))
    _, report = convert_model(mha, kind, calibration=[ids(3, 4, 16)], align=align)
    space, roles = MINIMISED[kind]
    for _, errs in report.layers:
        for role in roles:
            fit, naive = errs[role][space]
            assert fit <= naive + 1e-12, (kind, role, fit, naive)
            pooled = kind in ("mqa", "gqa")
            if not pooled or align:  # unaligned pooling is the naive initialisation itself
                assert fit < naive - 1e-3, (kind, role, fit, naive)
            else:
                assert fit == naive


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add", "mqa"])
def test_alignment_keeps_the_function_and_lowers_the_error(kind):
    """The rotations leave the source's function unchanged (so the error is measured against the
    same model), and the aligned fit's objective is never above the unaligned one."""
    h = _heads(seed=4)
    stats = input_stats_of(torch.randn(50, D_MODEL, dtype=torch.float64) + 0.3)
    plain = convert_sublayer(h, kind, stats=stats)
    aligned = convert_sublayer(h, kind, stats=stats, align=True)
    space, roles = MINIMISED[kind]
    for r in roles:
        assert aligned.errors[r][space][0] <= plain.errors[r][space][0] + 1e-12
        assert aligned.errors[r][space][0] < plain.errors[r][space][0] - 1e-3
    r_qk = procrustes(torch.randn(h.kv_heads, D, D, dtype=torch.float64))
    r_v = procrustes(torch.randn(h.kv_heads, D, D, dtype=torch.float64))
    turned = h.rotated(r_qk, r_v)
    x = torch.cat([torch.randn(5, D_MODEL, dtype=torch.float64), torch.ones(5, 1, dtype=torch.float64)], 1)
    for i in range(N_HEADS):
        before = (x @ h.q[i]) @ (x @ h.k[i]).T
        assert gap((x @ turned.q[i]) @ (x @ turned.k[i]).T, before) < 1e-12
        assert gap((x @ turned.v[i]) @ turned.out[i].T, (x @ h.v[i]) @ h.out[i].T) < 1e-12


def test_sha_is_the_best_rank_d_form_of_the_heads_logits_and_outputs():
    """SHA's W^Q W^K^T is the best rank-d approximation of the heads' mean logit form and
    W^V (sum of blocks)^T of their summed value-output map: a literal SVD, and no rank-d
    perturbation does better."""
    h = _heads(seed=9)
    res = convert_sublayer(h, "sha")
    st = res.state
    wq = torch.cat([st["q_proj.weight"].T, st["q_proj.bias"][None]])  # [p, d]
    wk = torch.cat([st["k_proj.weight"].T, st["k_proj.bias"][None]])
    mean_form = torch.einsum("npd,nqd->pq", h.q, h.k) / N_HEADS
    u, sv, vh = torch.linalg.svd(mean_form)
    assert gap(wq @ wk.T, (u[:, :D] * sv[:D]) @ vh[:D]) < 1e-12
    blocks = st["out_proj.weight"].reshape(D_MODEL, N_HEADS, D)
    assert torch.allclose(blocks, blocks[:, :1].expand(-1, N_HEADS, -1))  # equal blocks: 1/n of the sum
    wv = torch.cat([st["v_proj.weight"].T, st["v_proj.bias"][None]])
    summed = torch.einsum("npd,nmd->pm", h.v, h.out)
    u, sv, vh = torch.linalg.svd(summed)
    assert gap(wv @ blocks.sum(1).T, (u[:, :D] * sv[:D]) @ vh[:D]) < 1e-12
    assert convert_sublayer(h, "sha", align=True).state["q_proj.weight"].equal(st["q_proj.weight"])


def test_an_encoder_converts_and_its_structure_is_kept():
    enc = tiny("mha", arch="encoder")
    conv, report = convert_model(enc, "mhe-mul")
    assert conv.cfg.arch == "encoder" and conv.cfg.attention == "mhe-mul"
    assert len(report.layers) == 2
    same = {k for k in enc.state_dict() if "self_attn" not in k}
    assert all(torch.equal(conv.state_dict()[k], enc.state_dict()[k]) for k in same)


@pytest.mark.parametrize("source, kind, match", [
    ("mha", "fnet", "cannot convert to attention kind 'fnet'; valid targets: mhe-mul"),
    ("mha", "mha", "cannot convert to attention kind 'mha'"),
    ("mha", "skv", "cannot convert to attention kind 'skv'"),
    ("sha", "mhe-mul", "the source model's attention is 'sha', not multi-head"),
    ("mhe-mul", "mqa", "the source model's attention is 'mhe-mul', not multi-head"),
])
def test_bad_conversions_are_one_line_errors(source, kind, match):
    with pytest.raises(MheError, match=match) as e:
        convert_model(tiny(source), kind)
    assert "\n" not in str(e.value)


def test_gqa_groups_and_encoder_decoders_are_checked():
    with pytest.raises(MheError, match="n_kv_heads=3 must be a positive divisor of n_heads=4"):
        convert_model(tiny("mha"), "gqa", n_kv_heads=3)
    with pytest.raises(MheError, match="n_kv_heads=2 applies to gqa only"):
        convert_model(tiny("mha"), "mqa", n_kv_heads=2)
    seq = build_model("tiny-encoder-decoder", d_model=D_MODEL, n_heads=N_HEADS, n_layers=1, d_ff=64,
                      vocab_size=VOCAB, max_len=16)
    with pytest.raises(MheError, match="converting an encoder-decoder is not supported"):
        convert_model(seq, "mhe-mul")


def test_calibration_statistics_are_the_attention_inputs():
    mha = tiny("mha")
    x = ids(5, 3, 9)
    seen = []
    handle = mha.decoder.layers[1].self_attn.register_forward_pre_hook(lambda _m, a: seen.append(a[0].clone()))
    stats = input_stats(mha, [x])
    handle.remove()
    flat = seen[0].flatten(0, 1)  # [27, m]
    s = stats["decoder.layers.1.self_attn"]
    assert s.count == 27
    assert gap(s.mean, flat.mean(0)) < 1e-14 and gap(s.second, flat.T @ flat / 27) < 1e-14


def test_rotary_pairs_share_scales_and_alignment_keeps_to_them():
    """Under RoPE a head's query/key scale must be equal within each rotary pair (a rotation
    commutes with a scale only then) and queries/keys may be turned only within the pairs (and
    on the unrotated dimensions): a model exactly of MHE-Mul form with pair-shared scales converts
    back exactly, with or without alignment, and a random one is aligned in all three roles."""
    from types import SimpleNamespace

    from mhe.attention.mhe import MHEOptions
    from mhe.convert.rotary import rotary_fit

    assert rotary_fit(SimpleNamespace(positions="learned"), 8, "mhe-mul", MHEOptions()) is None
    rotary = rotary_fit(SimpleNamespace(positions="rotary", rope_fraction=0.5), 8, "mhe-mul", MHEOptions())
    groups = rotary.scale_groups()
    assert groups == [[0, 2], [1, 3], [4], [5], [6], [7]]  # rotate_half pairs over the first 4 dimensions
    g = torch.Generator().manual_seed(7)
    w = torch.randn(D_MODEL + 1, D, generator=g, dtype=torch.float64)
    scale = 1 + 0.5 * torch.randn(N_HEADS, D, generator=g, dtype=torch.float64)
    for grp in groups:
        scale[:, grp] = scale[:, grp[:1]]
    h = _heads(seed=8)
    exact = type(h)(q=w[None] * scale[:, None], k=w[None] * scale.flip(0)[:, None], v=h.v, out=h.out,
                    out_bias=h.out_bias, kv_heads=h.kv_heads, bias=True)
    for align in (False, True):
        res = convert_sublayer(exact, "mhe-mul", align=align, rotary=rotary)
        for r in "qk":
            assert res.errors[r]["weight"][0] < 1e-12
        emb = res.state["head_embed"]
        for grp in groups:
            assert torch.equal(emb[0][:, grp], emb[0][:, grp[:1]].expand(-1, len(grp)))
    plain = convert_sublayer(h, "mhe-mul", rotary=rotary, align=False)
    turned = convert_sublayer(h, "mhe-mul", rotary=rotary, align=True)
    for r in "qkv":
        assert turned.errors[r]["weight"][0] < plain.errors[r]["weight"][0] - 1e-3
