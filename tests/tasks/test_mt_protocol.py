"""WMT-14 protocol: checkpoint weight averaging, last-five BLEU from five checkpoints."""

import json

import pytest
import torch

from mhe.training.state import rng_state
from torch import nn

from mhe.errors import MheError
from mhe.tasks.mt_protocol import averaged_checkpoint_score, last_checkpoint_scores
from mhe.training import checkpoint as ckpt
from mhe.training.averaging import average_state_dicts, last_checkpoints


def test_average_of_five_known_state_dicts():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]  # mean 4.0
    states = [{"w": torch.full((2, 3), v, dtype=torch.float32) + torch.arange(3.0),
               "h": torch.full((2,), v / 3, dtype=torch.float64),
               "n": torch.tensor([7, 8])} for v in values]
    avg = average_state_dicts(states)
    assert avg["w"].dtype == torch.float32 and avg["h"].dtype == torch.float64
    assert torch.equal(avg["w"], torch.tensor([[4.0, 5.0, 6.0], [4.0, 5.0, 6.0]]))
    assert torch.allclose(avg["h"], torch.full((2,), 20.0 / 15, dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(avg["n"], torch.tensor([7, 8]))
    assert torch.equal(states[0]["w"][0], torch.tensor([1.0, 2.0, 3.0]))  # inputs untouched


def test_average_refuses_mismatched_states():
    a = {"w": torch.zeros(2), "n": torch.tensor(1)}
    with pytest.raises(MheError, match="other keys"):
        average_state_dicts([a, {"v": torch.zeros(2), "n": torch.tensor(1)}])
    with pytest.raises(MheError, match="different shapes"):
        average_state_dicts([a, {"w": torch.zeros(3), "n": torch.tensor(1)}])
    with pytest.raises(MheError, match="not a floating tensor"):
        average_state_dicts([a, {"w": torch.zeros(2), "n": torch.tensor(2)}])
    with pytest.raises(MheError, match="at least one"):
        average_state_dicts([])


def _save_five(root):
    model = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, v in zip((10, 20, 30, 40, 50, 60), (9.0, 1.0, 2.0, 3.0, 4.0, 10.0)):
        with torch.no_grad():
            model.weight.fill_(v)
        state = {"step": step, "optimizer": opt.state_dict(), "scheduler": {}, "rng": rng_state(), "data": {}}
        ckpt.save_checkpoint(root, model=model, state=state, keep_last=6)
    return model


def test_last_five_checkpoints_each_scored_and_averaged(tmp_path):
    model = _save_five(tmp_path)
    points = last_checkpoints(tmp_path, 5)
    assert [p.name for p in points] == [f"step-000000{s}" for s in (20, 30, 40, 50, 60)]
    score = lambda m: float(m.weight.detach().mean())  # noqa: E731
    per = last_checkpoint_scores(model, points, score)
    assert per == {"scores": [1.0, 2.0, 3.0, 4.0, 10.0], "steps": [20, 30, 40, 50, 60], "mean": 4.0}
    assert averaged_checkpoint_score(model, points, score) == 4.0
    assert float(model.weight.detach().mean()) == 10.0  # the caller's model is not changed


def _tiny_parallel(root, n=40):
    words = ["a", "b", "c", "d", "e", "f", "g"]
    d = root / "multi30k"
    d.mkdir()
    for split, count in (("train", n), ("val", 6), ("test_2016_flickr", 5)):
        en = [" ".join(words[(i + j) % 7] for j in range(3 + i % 3)) for i in range(count)]
        (d / f"{split}.en").write_text("\n".join(en) + "\n")
        (d / f"{split}.de").write_text("\n".join(s.upper() for s in en) + "\n")


def test_last5_protocol_decodes_the_last_five_checkpoints(tmp_path):
    from mhe.cli import main

    _tiny_parallel(tmp_path)
    out = tmp_path / "mt"
    args = ["train-mt", "--preset", "tiny-encoder-decoder", "--attention", "mha", "--data-dir", str(tmp_path),
            "--out", str(out), "--set", "train.steps=10", "--set", "train.save_every=2", "--set",
            "train.keep_last=5", "--set", "train.progress=false", "--set", "data.vocab_size=60",
            "--set", "model.d_model=32", "--set", "model.d_ff=64", "--set", "model.max_len=16",
            "--set", 'data.task_options={"protocol": "last5", "beam": 2, "max_tokens": 64, '
                     '"average_weights": true}']
    assert main(args) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["bleu_last5_steps"] == [2, 4, 6, 8, 10] and len(res["bleu_last5"]) == 5
    assert res["bleu_last5_mean"] == pytest.approx(sum(res["bleu_last5"]) / 5, abs=1e-12)
    assert res["score"] == res["bleu_last5_mean"] and "bleu_averaged_weights" in res
    # one of them again, by hand: checkpoint step 6 decoded with the final beam settings
    from mhe.tasks.runs import load_run
    from mhe.data.parallel_text import read_parallel
    from mhe.metrics.bleu import corpus_bleu

    model, _, task = load_run(out / "checkpoints" / "step-00000006", data_dir=str(tmp_path))
    src, ref = read_parallel("multi30k", "test", "en", "de", data_dir=tmp_path)
    assert corpus_bleu(task.translate(model, src), ref)["bleu"] == res["bleu_last5"][2]


def test_last5_needs_five_kept_checkpoints(tmp_path):
    from mhe.tasks.translation import TranslationTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.distributed import Dist

    _tiny_parallel(tmp_path)
    cfg = apply_overrides(default_run("mt", "tiny-encoder-decoder", "mha", "multi30k"),
                          ['data.task_options={"protocol": "last5"}', "data.vocab_size=60"])
    cfg.data.data_dir = str(tmp_path)
    with pytest.raises(MheError, match=r"set train.keep_last=5 \(got 2\)"):
        TranslationTask().setup(cfg, tmp_path / "out", Dist())


def test_checkpoint_every_epoch_sets_the_save_cadence(tmp_path):
    from mhe.tasks.translation import TranslationTask
    from mhe.training.config import apply_overrides
    from mhe.tasks import default_run
    from mhe.training.distributed import Dist

    _tiny_parallel(tmp_path)
    cfg = apply_overrides(default_run("mt", "tiny-encoder-decoder", "mha", "multi30k"),
                          ['data.task_options={"checkpoint_every": "epoch", "max_tokens": 64}', "data.vocab_size=60"])
    cfg.data.data_dir = str(tmp_path)
    task = TranslationTask()
    task.setup(cfg, tmp_path / "out", Dist())
    assert cfg.train.batch_size == 1 and cfg.train.save_every == len(task.batches) > 1
