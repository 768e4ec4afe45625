"""Every fine-tuning task end to end on a tiny pre-trained encoder (a few CPU steps each),
bad records named by file and record, several seeds aggregated."""

import gzip
import json
import math
import shutil

import pytest

from conftest import require_data
from mhe.cli import main
from mhe.data.benchmarks import read_examples
from mhe.errors import MheError
from mhe.tasks.finetune_config import default_finetune_dir

TINY = ["train.steps=3", "train.epochs=0", "train.progress=false", "train.warmup_steps=1", "train.warmup_ratio=0",
        "train.batch_size=8", "train.eval_every=0", "train.save_every=0"]


def pretrain(tmp, preset, task_data="ptb"):
    out = tmp / preset
    root = require_data("ptb/ptb.train.txt.gz")
    assert main(["pretrain", "--preset", preset, "--attention", "mhe-mul", "--data", task_data, "--data-dir", str(root),
                 "--out", str(out), "--set", "train.steps=4", "--set", "train.progress=false",
                 "--set", "data.limit_lines=600", "--set", "data.vocab_size=400"]) == 0
    return out


@pytest.fixture(scope="module")
def encoder_run(tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("pre"), "tiny-encoder")


@pytest.fixture(scope="module")
def decoder_run(tmp_path_factory):
    return pretrain(tmp_path_factory.mktemp("pre"), "tiny-decoder")


@pytest.fixture(scope="module")
def synthetic_data(tmp_path_factory):
    """The real data folder plus official-format stand-ins for files missing offline."""
    root = require_data("glue/RTE/train.tsv.gz")
    d = tmp_path_factory.mktemp("data")
    for sub in ("glue", "superglue", "squad"):
        shutil.copytree(root / sub, d / sub)
    (d / "glue" / "MNLI").mkdir()
    head = "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t" \
           "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
    rows = "".join(f"{i}\t0\t0\tfic\t-\t-\t-\t-\tA man sleeps {i}.\tSomeone rests.\tx\t{lab}\n"
                   for i, lab in enumerate(["entailment", "neutral", "contradiction"] * 8))
    for f in ("train.tsv", "dev_matched.tsv", "dev_mismatched.tsv"):
        (d / "glue" / "MNLI" / f).write_text(head + rows)
    (d / "glue" / "QQP").mkdir()
    qqp = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n" + "".join(
        f"{i}\t1\t2\tHow do I cook {i}?\tWhat is cooking {i}?\t{i % 2}\n" for i in range(24))
    (d / "glue" / "QQP" / "train.tsv").write_text(qqp)
    (d / "glue" / "QQP" / "dev.tsv").write_text(qqp)
    with gzip.open(root / "glue" / "QNLI" / "dev.tsv.gz", "rt") as f:
        (d / "glue" / "QNLI" / "train.tsv").write_text("".join(f.readlines()[:40]))
    with gzip.open(root / "superglue" / "BoolQ" / "val.jsonl.gz", "rt") as f:
        (d / "superglue" / "BoolQ" / "train.jsonl").write_text("".join(f.readlines()[:40]))
    ctx = "The tower was finished in 1889 in Paris. It is made of iron."
    v2 = {"data": [{"title": "t", "paragraphs": [{"context": ctx, "qas": [
        {"id": f"a{i}", "question": "When was the tower finished?", "is_impossible": False,
         "answers": [{"text": "1889", "answer_start": ctx.index("1889")}]} for i in range(6)] + [
        {"id": f"n{i}", "question": "Who painted the tower?", "is_impossible": True, "answers": []}
        for i in range(6)]}]}]}
    (d / "squad" / "v2.0").mkdir(parents=True)
    for f in ("train-v2.0.json", "dev-v2.0.json"):
        (d / "squad" / "v2.0" / f).write_text(json.dumps(v2))
    return d


ALL = ["cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "mnli-mm", "qnli", "rte", "wnli", "boolq", "cb", "sg-rte", "wic",
       "multirc", "copa", "wsc", "squad-v2"]
OFFICIAL = {"cola": "matthews_corrcoef", "mrpc": "accuracy", "qqp": "f1", "stsb": "spearman", "cb": "f1_macro",
            "multirc": "f1a", "squad-v2": "f1", "squad": "f1"}


@pytest.mark.parametrize("task", ALL)
def test_every_task_end_to_end(task, encoder_run, synthetic_data, tmp_path):
    out = tmp_path / task
    opts = {"train_limit": 16, "dev_limit": 24}
    assert main(["finetune", "--task", task, "--checkpoint", str(encoder_run), "--data-dir", str(synthetic_data),
                 "--out", str(out), *sum((["--set", s] for s in TINY), []),
                 "--set", f"data.task_options={json.dumps(opts)}"]) == 0
    res = json.loads((out / "results.json").read_text())
    assert res["metric"] == OFFICIAL.get(task, "accuracy")
    assert math.isfinite(res["score"]) and res["score"] == res[res["metric"]]
    assert all(math.isfinite(res[m]) for m in res["official_metrics"])  # every official metric is shown
    if task == "mrpc":
        assert res["official_metrics"] == ["f1", "accuracy"]
    if task == "squad-v2":
        assert {"HasAns_f1", "NoAns_f1"} <= set(res)
    if task == "multirc":
        assert "em" in res


def test_squad_v11_trains_on_a_labelled_part_of_dev(encoder_run, tmp_path):
    root = require_data("squad/v1.1/dev-v1.1.json.xz")
    opts = {"train_split": "dev", "dev_split": "dev", "dev_offset": 40, "dev_limit": 30, "train_limit": 40}
    assert main(["finetune", "--task", "squad", "--checkpoint", str(encoder_run), "--data-dir", str(root),
                 "--out", str(tmp_path / "sq"), *sum((["--set", s] for s in TINY), []),
                 "--set", f"data.task_options={json.dumps(opts)}"]) == 0
    res = json.loads((tmp_path / "sq" / "results.json").read_text())
    assert res["metric"] == "f1" and res["total"] == 30 and 0 <= res["exact_match"] <= res["f1"] <= 100


def test_finetune_default_folder_names_task_and_pretraining_run(encoder_run, tmp_path, monkeypatch):
    root = require_data("glue/RTE/train.tsv.gz")
    monkeypatch.chdir(tmp_path)
    opts = {"train_limit": 8, "dev_limit": 8}
    assert main(["finetune", "--task", "rte", "--checkpoint", str(encoder_run) + "/", "--data-dir", str(root),
                 *sum((["--set", s] for s in TINY), []), "--set", f"data.task_options={json.dumps(opts)}"]) == 0
    made = list((tmp_path / "runs").glob(f"finetune-rte-{encoder_run.name}-*"))
    assert len(made) == 1 and (made[0] / "results.json").is_file() and len(made[0].name.rsplit("-", 1)[1]) == 6
    # a pre-training run of the same name elsewhere gets a folder of its own
    twin = tmp_path / "elsewhere" / encoder_run.name
    shutil.copytree(encoder_run, twin)
    assert default_finetune_dir("rte", str(twin)) != default_finetune_dir("rte", str(encoder_run))
    assert default_finetune_dir("rte", str(encoder_run)) == default_finetune_dir("rte", str(encoder_run) + "/")


def test_finetune_reruns_follow_the_rerun_rule(encoder_run, tmp_path, capsys):
    """The same configuration again: reported and its result printed; a changed one (train.steps
    3 -> 4): refused in one line naming the difference and a free folder, nothing trained."""
    root = require_data("glue/RTE/train.tsv.gz")
    out = tmp_path / "ft"
    args = ["finetune", "--task", "rte", "--run", str(encoder_run), "--data-dir", str(root), "--out", str(out),
            *sum((["--set", s] for s in TINY), []), "--set", 'data.task_options={"train_limit": 8, "dev_limit": 8}']
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    stamp = (out / "results.json").stat().st_mtime_ns
    assert main(args) == 0
    again = capsys.readouterr()
    assert json.loads(again.out) == first and f"already finished: results in {out}" in again.err
    assert main(args + ["--set", "train.steps=4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "(train.steps: 3 there, 4 now)" in err and f"{out}-2 is free" in err
    assert (out / "results.json").stat().st_mtime_ns == stamp
    assert json.loads((out / "config.json").read_text())["run"]["train"]["steps"] == 3


@pytest.mark.parametrize("progress", [True, False])
def test_squad_final_evaluation_reports_progress(progress, encoder_run, tmp_path, capsys):
    """The dev forward passes and SQuAD's answer extraction each show a bar on stderr with
    train.progress on, and nothing with it off; the scores are the same."""
    root = require_data("squad/v1.1/dev-v1.1.json.xz")
    opts = {"train_split": "dev", "dev_split": "dev", "dev_offset": 40, "dev_limit": 12, "train_limit": 40}
    capsys.readouterr()
    assert main(["finetune", "--task", "squad", "--checkpoint", str(encoder_run), "--data-dir", str(root),
                 "--out", str(tmp_path / "sq"), *sum((["--set", s] for s in TINY), []),
                 "--set", f"data.task_options={json.dumps(opts)}",
                 "--set", f"train.progress={str(progress).lower()}"]) == 0
    err = capsys.readouterr().err
    if progress:
        assert "evaluating squad" in err and "SQuAD answers" in err and "final evaluation (squad)" in err
    else:
        assert err == ""


def test_decoder_fine_tunes_on_glue_and_seeds_aggregate(decoder_run, tmp_path, capsys):
    root = require_data("glue/MRPC/train.tsv.gz")
    opts = {"train_limit": 16, "dev_limit": 24}
    assert main(["finetune", "--task", "mrpc", "--checkpoint", str(decoder_run), "--data-dir", str(root),
                 "--out", str(tmp_path / "dec"), "--seeds", "2", *sum((["--set", s] for s in TINY), []),
                 "--set", f"data.task_options={json.dumps(opts)}"]) == 0
    summary = json.loads((tmp_path / "dec" / "summary.json").read_text())
    s0, s1 = (json.loads((tmp_path / "dec" / f"seed-{i}" / "results.json").read_text())["score"] for i in (0, 1))
    assert summary["n_seeds"] == 2 and summary["mean"] == pytest.approx((s0 + s1) / 2)
    cfg = json.loads((tmp_path / "dec" / "seed-0" / "config.json").read_text())
    assert cfg["model"]["arch"] == "decoder" and cfg["model"]["head"] == "classification"


def test_squad_requires_an_encoder(decoder_run, tmp_path):
    root = require_data("squad/v1.1/dev-v1.1.json.xz")
    assert main(["finetune", "--task", "squad", "--checkpoint", str(decoder_run), "--data-dir", str(root),
                 "--out", str(tmp_path / "x")]) == 2


def test_bad_records_are_named(tmp_path):
    (tmp_path / "glue" / "RTE").mkdir(parents=True)
    (tmp_path / "glue" / "RTE" / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tmaybe\n")
    with pytest.raises(MheError, match=r"RTE/dev.tsv: line 2: label 'maybe' is not one of entailment, not_entailment"):
        read_examples("rte", "dev", data_dir=tmp_path)
    (tmp_path / "superglue" / "CB").mkdir(parents=True)
    (tmp_path / "superglue" / "CB" / "val.jsonl").write_text('{"premise": "a", "label": "neutral"}\n')
    with pytest.raises(MheError, match=r"CB/val.jsonl: record 1: missing field 'hypothesis'"):
        read_examples("cb", "dev", data_dir=tmp_path)
    with pytest.raises(MheError, match="unknown fine-tuning task 'glue'"):
        read_examples("glue", "dev")


def test_input_construction():
    root = require_data("superglue/WiC/val.jsonl.gz", "superglue/WSC/val.jsonl", "superglue/COPA/val.jsonl")
    wic = read_examples("wic", "dev", data_dir=root)[0]
    assert wic.text_a == "class: An emerging professional *class*." and "*class*" in wic.text_b
    wsc = read_examples("wsc", "dev", data_dir=root)[0]
    assert "*anyone*" in wsc.text_a and "#him#" in wsc.text_a
    copa = read_examples("copa", "dev", data_dir=root)[0]
    assert copa.text_a.endswith("What happened as a result?") and len(copa.choices) == 2 and copa.label == 1
    mrc = read_examples("multirc", "dev", data_dir=root)
    assert len({e.group for e in mrc}) == 953  # MANIFEST: 953 questions


def test_hub_path_maps_rows_onto_the_same_examples(monkeypatch):
    """With ``datasets`` present, hub rows become the same examples as the local files
    (a stand-in ``datasets`` module serves rows in the hub's formats)."""
    import sys
    import types

    root = require_data("superglue/WiC/val.jsonl.gz", "glue/RTE/dev.tsv.gz")
    local_wic = read_examples("wic", "dev", data_dir=root)[:3]
    local_rte = read_examples("rte", "dev", data_dir=root)[:3]
    wic_rows = [{"word": "class", "sentence1": "An emerging professional class.", "sentence2":
                 "Apologizing for losing your temper, even though you were badly provoked, showed real class.",
                 "start1": 25, "end1": 30, "start2": 85, "end2": 90, "idx": 0, "label": 0}]
    rte_rows = [{"sentence1": e.text_a, "sentence2": e.text_b, "label": e.label, "idx": i}
                for i, e in enumerate(local_rte)]
    squad_rows = [{"id": "q1", "question": "When?", "context": "In 1889 it opened.",
                   "answers": {"text": ["1889"], "answer_start": [3]}}]
    served = {("aps/super_glue", "wic"): wic_rows, ("nyu-mll/glue", "rte"): rte_rows,
              ("rajpurkar/squad", None): squad_rows}
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda name, config, split: served[(name, config)]
    monkeypatch.setitem(sys.modules, "datasets", fake)
    hub_wic = read_examples("wic", "dev", source="hub")
    assert (hub_wic[0].text_a, hub_wic[0].text_b, hub_wic[0].label) == (
        local_wic[0].text_a, local_wic[0].text_b, local_wic[0].label)
    hub_rte = read_examples("rte", "dev", source="hub")
    assert [(e.text_a, e.label) for e in hub_rte] == [(e.text_a, e.label) for e in local_rte]
    sq = read_examples("squad", "dev", source="hub")[0]
    assert sq.answers == [("1889", 3)] and sq.text_b[3:7] == "1889"


def test_hub_path_offline_says_what_is_missing(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(MheError, match="needs the optional 'datasets' package .*put glue/RTE/dev.tsv under --data-dir"):
        read_examples("rte", "dev", source="hub")


def test_wnli_and_diagnostic_readers_on_the_real_files():
    root = require_data("glue/WNLI/dev.tsv", "superglue/AX-b/AX-b.jsonl.gz", "superglue/AX-g/AX-g.jsonl.gz")
    train, dev = read_examples("wnli", "train", data_dir=root), read_examples("wnli", "dev", data_dir=root)
    assert (len(train), len(dev)) == (635, 71) and sum(e.label for e in dev) == 31  # majority 40/71 is 0
    axb = read_examples("ax-b", "test", data_dir=root)
    assert len(axb) == 1104 and sum(e.label == 0 for e in axb) == 460 and axb[0].group == "Negation"
    axg = read_examples("ax-g", "test", data_dir=root)
    assert len(axg) == 356 and len({e.group for e in axg}) == 178
    assert axg[0].group == axg[1].group and axg[0].text_b == axg[1].text_b and axg[0].text_a != axg[1].text_a


def _jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_diagnostics_score_an_rte_run(encoder_run, tmp_path, capsys):
    """AX-b and AX-g through a model fine-tuned on RTE: the reported Matthews correlation,
    accuracy and gender parity are those of the written predictions, recomputed by hand."""
    root = require_data("glue/RTE/train.tsv.gz")
    d = tmp_path / "data"
    shutil.copytree(root / "glue" / "RTE", d / "glue" / "RTE")
    labels = ["entailment", "not_entailment"]
    axb = [{"idx": i, "sentence1": f"The cat sat on mat {i}.", "sentence2": ["A cat sat.", "No cat sat."][i % 2] * (1 + i % 3),
            "label": labels[(i // 2) % 2], "logic": "Negation"} for i in range(12)]
    axg = []
    for i in range(5):
        for j, pron in enumerate(("his", "her")):
            axg.append({"idx": 2 * i + j, "premise": f"The nurse {i} met the patient to discuss {pron} results.",
                        "hypothesis": f"The patient {i} had results.", "label": labels[i % 2], "pair_id": 10 * i + 2 * j})
    _jsonl(d / "superglue" / "AX-b" / "AX-b.jsonl", axb)
    _jsonl(d / "superglue" / "AX-g" / "AX-g.jsonl", axg)
    run = tmp_path / "rte"
    opts = {"train_limit": 16, "dev_limit": 8}
    assert main(["finetune", "--task", "rte", "--checkpoint", str(encoder_run), "--data-dir", str(d), "--out", str(run),
                 *sum((["--set", s] for s in TINY), []), "--set", f"data.task_options={json.dumps(opts)}"]) == 0
    capsys.readouterr()
    assert main(["diagnostics", "--checkpoint", str(run), "--out", str(tmp_path / "sub")]) == 0
    res = json.loads(capsys.readouterr().out)
    pb = [labels.index(json.loads(x)["label"]) for x in (tmp_path / "sub" / "AX-b.jsonl").read_text().splitlines()]
    gb = [labels.index(r["label"]) for r in axb]
    tp = sum(p == g == 0 for p, g in zip(pb, gb))
    tn = sum(p == g == 1 for p, g in zip(pb, gb))
    fp = sum(p == 0 and g == 1 for p, g in zip(pb, gb))
    fn = sum(p == 1 and g == 0 for p, g in zip(pb, gb))
    den = math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))
    mcc = (tp * tn - fp * fn) / den if den else 0.0
    assert res["ax-b"]["metric"] == "matthews_corrcoef" and res["ax-b"]["score"] == pytest.approx(mcc, abs=1e-12)
    assert res["ax-b"]["total"] == 12
    pg = [json.loads(x)["label"] for x in (tmp_path / "sub" / "AX-g.jsonl").read_text().splitlines()]
    assert res["ax-g"]["metric"] == "gender_parity"
    assert res["ax-g"]["gender_parity"] == pytest.approx(sum(pg[2 * i] == pg[2 * i + 1] for i in range(5)) / 5)
    assert res["ax-g"]["accuracy"] == pytest.approx(sum(p == r["label"] for p, r in zip(pg, axg)) / 10)
    assert main(["diagnostics", "--checkpoint", str(encoder_run)]) == 2  # not an RTE run
