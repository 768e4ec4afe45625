"""``mhe convert --fit outputs`` (:mod:`mhe.convert.outputs`): a planted MHE source (an MHE model
written as MHA weights) comes back exactly; on a source of no MHE form the output fit's error on
held-out calibration sequences never exceeds the weight fit's, falls below it, and is what the
converted sublayer computes on those sequences (recomputed here from the source's own inputs);
bad options are one-line errors (API and command line, exit 2, nothing written)."""

import json

import pytest
import torch

from conftest import require_data
from mhe.cli import main
from mhe.convert import attention_modules, convert_model
from mhe.convert.outputs import OutputFit
from mhe.errors import MheError
from test_convert_llama_cli import convert, llama_run  # noqa: F401 (a fixture)
from test_convert_rotary import embeddings, gap, ids, llama, logits, per_head_source

TOL = 1e-10


def batches(n=4, b=4, t=16):
    return [ids(10 + s, b, t) for s in range(n)]


@pytest.mark.parametrize("kind,order", [("mhe-mul", "rope-then-psi"), ("mhe-mul", "psi-then-rope"),
                                        ("mhe-add", "psi-then-rope")])
def test_a_planted_mhe_source_converts_back_exactly_with_the_output_fit(kind, order):
    mhe = embeddings(llama(kind, rope_order=order), pairs=order == "rope-then-psi")
    src = per_head_source(mhe)
    assert gap(logits(src), logits(mhe)) < TOL  # the source is the MHE model, as MHA weights (MHE-Add: its
    # offsets before the rotation are per-head biases; after it, no MHA holds them)
    cal = batches()
    conv, report = convert_model(src, kind, options={"rope_order": order}, calibration=cal,
                                 output_fit=OutputFit(steps=20, lr=1e-2), fit_batches=cal)
    layers = report.options["output_fit"]["layers"]
    assert len(layers) == 2 and all(r["weight_fit"] < TOL and r["output_fit"] <= r["weight_fit"] for r in layers)
    assert gap(logits(conv), logits(mhe)) < TOL


def _held_out_error(src, conv, held):
    """The literal relative error of every converted sublayer on the source's own sublayer inputs
    and outputs over the ``held`` batches (recorded here by hooks, not by the module tested)."""
    num, den = {}, {}
    targets = dict(attention_modules(conv))
    for name, mod in attention_modules(src):
        def hook(m, args, kwargs, out, name=name):
            y = targets[name](args[0], positions=kwargs["positions"], mask=kwargs["mask"])
            num[name] = num.get(name, 0.0) + float((y - out).pow(2).sum())
            den[name] = den.get(name, 0.0) + float(out.pow(2).sum())
        mod.register_forward_hook(hook, with_kwargs=True)
    with torch.no_grad():
        for x in held:
            src(x)
    return {name: (num[name] / den[name]) ** 0.5 for name in num}


@pytest.mark.parametrize("kind", ["mhe-mul", "mhe-add"])
def test_the_output_fit_never_exceeds_the_weight_fit_on_held_out_calibration(kind):
    src = llama("mha")
    cal = batches(n=4, b=8)
    weight, _ = convert_model(src, kind, calibration=cal)
    conv, report = convert_model(src, kind, calibration=cal, output_fit=OutputFit(steps=60, lr=3e-3),
                                 fit_batches=cal)
    layers = report.options["output_fit"]["layers"]
    held = cal[-1:]  # 4 batches, a quarter held out: the last one
    assert all(r["held_out_tokens"] == 8 * 16 for r in layers)
    before, after = _held_out_error(src, weight, held), _held_out_error(src, conv, held)
    for r in layers:
        name = r["sublayer"]
        assert r["weight_fit"] == pytest.approx(before[name], rel=1e-9)
        assert r["output_fit"] == pytest.approx(after[name], rel=1e-9)
        assert r["output_fit"] <= r["weight_fit"]
        assert r["kept"] == ("outputs" if r["output_fit"] < r["weight_fit"] else "weights")
    assert min(r["weight_fit"] - r["output_fit"] for r in layers) > 1e-3  # it does lower the error here


def test_without_the_output_fit_the_conversion_is_unchanged():
    src, cal = llama("mha"), batches()
    plain, report = convert_model(src, "mhe-mul", calibration=cal)
    naive, _ = convert_model(src, "mhe-mul", calibration=cal, naive=True, output_fit=OutputFit(), fit_batches=cal)
    again, _ = convert_model(src, "mhe-mul", calibration=cal, fit_batches=cal)
    assert "output_fit" not in report.options
    assert gap(logits(again), logits(plain)) == 0  # fit_batches alone change nothing
    assert gap(logits(naive), logits(convert_model(src, "mhe-mul", naive=True)[0])) == 0  # naive: no fit


@pytest.mark.parametrize("kwargs,match", [
    (dict(steps=0), "--fit-steps must be a number of steps >= 1, got 0"),
    (dict(lr=0.0), "--fit-lr must be a learning rate > 0, got 0.0"),
    (dict(lr=float("nan")), "--fit-lr must be a learning rate > 0, got nan"),
    (dict(held_out=1.0), "held-out share must be in (0, 1), got 1.0"),
])
def test_bad_output_fit_options_are_one_line_errors(kwargs, match):
    with pytest.raises(MheError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        OutputFit(**kwargs)
    assert "\n" not in str(e.value)


def test_too_few_calibration_batches_are_refused():
    with pytest.raises(MheError, match="needs at least 9 calibration sequences"):
        convert_model(llama("mha"), "mhe-mul", output_fit=OutputFit(), fit_batches=batches(n=1))
    with pytest.raises(MheError, match="the output fit needs calibration sequences"):
        convert_model(llama("mha"), "mhe-mul", output_fit=OutputFit())


def test_convert_fit_outputs_writes_the_fit_in_its_report(llama_run, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "mul"
    assert convert(llama_run, out, "mhe-mul", "--fit", "outputs", "--fit-steps", "5", "--calibration", "16") == 0
    report = json.loads((out / "conversion.json").read_text())
    fit = report["options"]["output_fit"]
    assert fit["steps"] == 5 and fit["lr"] == 1e-3 and len(fit["layers"]) == 1
    assert fit["layers"][0]["output_fit"] <= fit["layers"][0]["weight_fit"]
    assert "output fit (5 Adam steps a sublayer" in capsys.readouterr().out


@pytest.mark.parametrize("args,match", [
    (["--fit", "activations"], "argument --fit: invalid choice: 'activations'"),
    (["--fit", "outputs", "--fit-steps", "0"], "--fit-steps must be a number of steps >= 1, got 0"),
    (["--fit", "outputs", "--fit-lr", "-1"], "--fit-lr must be a learning rate > 0, got -1.0"),
    (["--fit", "outputs", "--calibration", "8"], "--fit outputs needs at least 9 calibration sequences"),
    (["--fit", "outputs", "--calibration", "0"], "--fit outputs needs at least 9 calibration sequences"),
])
def test_bad_fit_options_are_one_line_and_exit_2(llama_run, tmp_path, capsys, args, match):  # noqa: F811
    require_data("ptb/ptb.train.txt.gz")
    try:  # argparse's own refusals exit from the parser
        rc = main(["convert", "--checkpoint", str(llama_run), "--attention", "mhe-mul", "--device", "cpu",
                   "--out", str(tmp_path / "x"), *args])
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err
    assert not (tmp_path / "x").exists()
