"""Distillation of a teacher's logits during language-model training (``train.distill_from``,
:mod:`mhe.tasks.distill`): the loss equals a literal cross-entropy and KL written out term by term;
on a tiny model the teacher is frozen, in eval mode and gets no gradient; ``mhe pretrain
--init-from CONVERTED --set train.distill_from=SOURCE`` trains (weight 0 is the plain run, bit for
bit); bad settings are one-line errors; runs without distillation keep their hashes."""

import json
import math
import shutil

import pytest
import torch

from conftest import require_data
from mhe.cli import main
from mhe.models import build_model
from mhe.tasks import build_run
from mhe.tasks.distill import Distiller, distill_loss
from test_convert_cli import converted, mha_run  # noqa: F401 (fixtures)


def _reference(logits, teacher, labels, w, temp):
    """(1 - w) * CE + w * T^2 * KL(p_teacher,T || p_model,T), every sum written out."""
    b, t, v = logits.shape
    ce, kl, n = 0.0, 0.0, 0
    for i in range(b):
        for j in range(t - 1):
            y = int(labels[i, j + 1])
            if y == -100:
                continue
            row = [float(z) for z in logits[i, j]]
            trow = [float(z) for z in teacher[i, j]]
            log_z = math.log(sum(math.exp(z) for z in row))
            ce += log_z - row[y]
            ls = [z / temp for z in row]
            lt = [z / temp for z in trow]
            zs, zt = math.log(sum(math.exp(z) for z in ls)), math.log(sum(math.exp(z) for z in lt))
            kl += sum(math.exp(lt[k] - zt) * ((lt[k] - zt) - (ls[k] - zs)) for k in range(v))
            n += 1
    return (1 - w) * ce / n + w * temp ** 2 * kl / n


@pytest.mark.parametrize("w,temp", [(0.5, 1.0), (0.3, 2.0), (1.0, 0.5), (0.0, 1.0)])
def test_the_loss_is_the_literal_cross_entropy_and_kl(w, temp):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    teacher = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[1, 2] = -100  # an ignored position is in neither term
    got = distill_loss(logits, teacher, labels, weight=w, temperature=temp)
    assert float(got) == pytest.approx(_reference(logits, teacher, labels, w, temp), rel=1e-6, abs=1e-7)


def tiny(seed):
    torch.manual_seed(seed)
    return build_model("llama-tiny", d_model=16, n_heads=4, n_layers=1, d_ff=32, vocab_size=11, max_len=8,
                       dropout=0.1)


def test_on_a_tiny_model_the_teacher_is_frozen_and_the_loss_is_the_reference():
    student, teacher = tiny(0), tiny(1).requires_grad_(False)
    x = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(4))
    d = Distiller(teacher.train(), weight=0.4, temperature=2.0)  # a teacher left in train mode is set to eval
    student.eval()  # no dropout, so the reference below sees the same logits
    loss = d.loss(student, x)
    assert not teacher.training
    with torch.no_grad():
        ref = _reference(student(x).logits, teacher(x).logits, x, 0.4, 2.0)
    assert float(loss.detach()) == pytest.approx(ref, rel=1e-5)
    loss.backward()
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None for p in student.parameters() if p.requires_grad)


PTB = ["--data", "ptb", "--set", "train.steps=2", "--set", "train.progress=false", "--set", "data.limit_lines=200",
       "--set", "train.batch_size=4"]


def _uptrain(source, out, *sets):
    root = require_data("ptb/ptb.train.txt.gz")
    return main(["pretrain", "--init-from", str(source), "--data-dir", str(root), "--out", str(out), *PTB,
                 *[a for s in sets for a in ("--set", s)]])


def test_pretrain_init_from_distils_the_source(converted, mha_run, tmp_path):  # noqa: F811
    assert _uptrain(converted, tmp_path / "plain") == 0
    assert _uptrain(converted, tmp_path / "w0", f"train.distill_from={mha_run}", "train.distill_weight=0") == 0
    assert _uptrain(converted, tmp_path / "kd", f"train.distill_from={mha_run}", "train.distill_weight=0.5",
                    "train.distill_temperature=2") == 0
    res = {k: json.loads((tmp_path / k / "results.json").read_text()) for k in ("plain", "w0", "kd")}
    train = json.loads((tmp_path / "kd" / "config.json").read_text())["run"]["train"]
    assert train["distill_from"] == str(mha_run) and train["distill_temperature"] == 2.0
    assert res["w0"]["score"] == res["plain"]["score"]  # weight 0: the plain run, bit for bit
    assert res["kd"]["score"] != res["plain"]["score"] and math.isfinite(res["kd"]["score"])


@pytest.mark.parametrize("items,match", [
    (["train.distill_weight=1.5"], "train.distill_weight"),
    (["train.distill_temperature=0"], "train.distill_temperature"),
    (["train.distill_from=/nonexistent/teacher"], "train.distill_from"),
])
def test_bad_distillation_settings_are_one_line_and_exit_2(converted, tmp_path, capsys, items, match):  # noqa: F811
    assert _uptrain(converted, tmp_path / "x", *items) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and match in err, err
    assert not (tmp_path / "x").exists()


def test_a_teacher_with_another_tokenizer_is_refused(converted, mha_run, tmp_path, capsys):  # noqa: F811
    other = tmp_path / "teacher"
    shutil.copytree(mha_run, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "x"] = vocab.pop(first)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    assert _uptrain(converted, tmp_path / "x", f"train.distill_from={other}") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "has another tokenizer than this run" in err, err


def test_distillation_is_for_language_models_and_leaves_other_hashes_alone():
    plain = build_run("lm", "tiny-decoder", data="ptb")
    assert not {"distill_from", "distill_weight", "distill_temperature"} & set(plain.identity()["train"])
    kd = build_run("lm", "tiny-decoder", data="ptb", overrides=["train.distill_from=runs/x"])
    assert kd.identity()["train"]["distill_from"] == "runs/x" and kd.hash() != plain.hash()
    from mhe.errors import MheError

    with pytest.raises(MheError, match="train.distill_from is for causal language modelling"):
        build_run("mlm", "tiny-encoder", data="wikitext-2", overrides=["train.distill_from=runs/x"])
