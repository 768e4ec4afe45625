"""The faster conversion paths compute what the slower ones did: MHE-Mul's rank-1 fit from the
n x n Gram matrix equals the leading SVD triplet of each stacked column (a literal reference
here), the output fit on sublayers recorded once equals the fit that records them itself, a
:class:`~mhe.convert.runs.Converter` records its source once for all its output fits, the CPU
fit leaves torch's thread setting as it was, and (GPU) the fit on CUDA equals the CPU fit."""

import math

import pytest
import torch

import mhe.convert.runs as runs_module
from mhe.convert import convert_model
from mhe.convert.fit import rank1_scales, top_singular
from mhe.convert.outputs import OutputFit, record_sublayers
from test_convert_llama_cli import llama_run  # noqa: F401 (a fixture)
from test_convert_rotary import embeddings, ids, llama, per_head_source

TOL = 1e-12


def _svd_rank1(a, groups):
    """The literal reference: per group of columns, the stacked p*size x n matrix's SVD; w s^T =
    sigma u v^T with ||s|| = sqrt(n), sum(s) >= 0 (rank1_scales's normalisation)."""
    n, p, d = a.shape
    w, s = torch.zeros(p, d, dtype=a.dtype), torch.ones(n, d, dtype=a.dtype)
    for g in groups:
        mat = torch.cat([a[:, :, j].T for j in g])  # [size*p, n]
        u, sig, vh = torch.linalg.svd(mat, full_matrices=False)
        sign = 1.0 if float(vh[0].sum()) >= 0 else -1.0
        scale = sign * math.sqrt(n)
        col = u[:, 0] * sig[0] / scale
        for i, j in enumerate(g):
            w[:, j], s[:, j] = col[i * p:(i + 1) * p], vh[0] * scale
    return w, s


@pytest.mark.parametrize("pairs", [False, True])
def test_rank1_scales_equal_the_svd_fit(pairs):
    g = torch.Generator().manual_seed(0)
    n, p, d = 8, 33, 8
    a = torch.randn(n, p, d, generator=g, dtype=torch.float64)
    a[:, :, 0] = torch.randn(p, 1, generator=g, dtype=torch.float64).T * torch.randn(n, 1, generator=g,
                                                                                   dtype=torch.float64)  # rank 1
    groups = [[j, j + d // 2] for j in range(d // 2)] if pairs else [[j] for j in range(d)]
    w, s = rank1_scales(a, groups)
    w_ref, s_ref = _svd_rank1(a, groups)
    assert float((w - w_ref).abs().max()) < TOL * float(w_ref.abs().max())
    assert float((s - s_ref).abs().max()) < TOL * math.sqrt(n)


def test_top_singular_is_the_leading_svd_triplet_and_zero_for_a_zero_matrix():
    g = torch.Generator().manual_seed(1)
    mats = torch.randn(5, 200, 6, generator=g, dtype=torch.float64)
    mats[4] = 0
    u, sig, v = top_singular(mats)
    uu, ss, vh = torch.linalg.svd(mats[:4], full_matrices=False)
    ref = ss[:, 0, None, None] * uu[:, :, :1] * vh[:, None, 0, :]  # sigma_1 u_1 v_1^T
    got = sig[:4, None, None] * u[:4, :, None] * v[:4, None, :]
    assert float((got - ref).abs().max()) < TOL * float(ref.abs().max())
    assert float(sig[4]) == 0 and float(u[4].abs().max()) == 0


def test_the_output_fit_on_recorded_sublayers_equals_the_fit_that_records_them():
    src = llama()
    cal = [ids(10 + k, 4, 16) for k in range(4)]
    fit = OutputFit(steps=15, lr=1e-2)
    a, rep_a = convert_model(src, "mhe-mul", calibration=cal, output_fit=fit, fit_batches=cal)
    b, rep_b = convert_model(src, "mhe-mul", calibration=cal, output_fit=fit, recorded=record_sublayers(src, cal))
    assert rep_a.options["output_fit"] == rep_b.options["output_fit"]
    sa, sb = a.state_dict(), b.state_dict()
    assert all(float((sa[k] - sb[k]).abs().max()) <= TOL * float(sa[k].abs().max().clamp_min(1)) for k in sa)
    assert any(r["kept"] == "outputs" for r in rep_a.options["output_fit"]["layers"])  # the descent mattered


def test_a_converter_records_its_source_once_for_every_output_fit(llama_run, monkeypatch):  # noqa: F811
    calls = []
    real = runs_module.record_sublayers
    monkeypatch.setattr(runs_module, "record_sublayers", lambda *a, **k: calls.append(1) or real(*a, **k))
    fit = OutputFit(steps=3)
    with runs_module.Converter(llama_run, device="cpu", calibration=16, evaluate=False, log=lambda _m: None) as conv:
        _, first = conv.convert("mhe-mul", None, output_fit=fit)
        _, again = conv.convert("mhe-mul", None, output_fit=fit)
        conv.convert("mqa", None, output_fit=fit)
    assert len(calls) == 1
    assert first.options["output_fit"] == again.options["output_fit"]


def test_the_cpu_fit_leaves_the_thread_setting_as_it_was():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        convert_model(llama(), "mhe-mul", calibration=[ids(1, 2, 8)])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mhe-mul", "mqa", "mhe-add"])
def test_the_fit_on_a_gpu_equals_the_cpu_fit(kind):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    src = per_head_source(embeddings(llama("mhe-mul"))) if kind == "mhe-mul" else llama()
    cal = [ids(1, 4, 16)]
    cpu, rep_cpu = convert_model(src, kind, calibration=cal)
    gpu, rep_gpu = convert_model(src, kind, calibration=cal, device="cuda")
    assert next(gpu.parameters()).device.type == "cpu"  # returned on the CPU, as the CPU fit
    sc, sg = cpu.state_dict(), gpu.state_dict()
    assert all(float((sc[k] - sg[k]).abs().max()) <= 1e-6 * float(sc[k].abs().max().clamp_min(1)) for k in sc)
    for (_, ec), (_, eg) in zip(rep_cpu.layers, rep_gpu.layers):
        for role in ec:
            for space in ec[role]:
                assert all(abs(x - y) < 1e-9 for x, y in zip(ec[role][space], eg[role][space]))
