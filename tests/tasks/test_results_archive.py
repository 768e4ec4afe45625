"""results/ as committed: each experiment's run files packed in one deterministic ``runs.tar.xz``
(:mod:`mhe.experiments.run_archive`) that ``mhe report`` and ``mhe compare --resume`` read as it is,
``mhe report --pack``/``--unpack`` both ways, and no machine's path in any committed file or member."""

import io
import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from mhe.cli import main
from mhe.errors import MheError
from mhe.experiments.run_archive import RunFiles, archive_bytes, pack, read_archive, unpack
from mhe.experiments.sweep import Sweep, run_sweep
from mhe.output_paths import portable_path, shown_path
from mhe.tasks import default_run

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
MACHINE_PATHS = (b"/work/", b"/root/", b"/home/", b"/tmp/")
SUMMARY = ("summary.json", "summary.md", "summary.csv")


def committed_files() -> list[Path]:
    """The files of results/ as git tracks them (the checkout's files where git is not there)."""
    try:
        names = subprocess.run(["git", "ls-files", "-z", "results"], cwd=ROOT, capture_output=True,
                               check=True).stdout.decode().split("\0")
        return [ROOT / n for n in names if n and (ROOT / n).is_file()]
    except (OSError, subprocess.CalledProcessError):
        return [p for p in RESULTS.rglob("*") if p.is_file()]


def make_runs(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


FILES = {"runs/mha-seed0/results.json": b'{"score": 1.5}\n', "runs/mha-seed0/metrics.jsonl": b'{"step": 2}\n',
         "runs/sha-seed0/results.json": b'{"score": 2.5}\n', "runs/sha-seed1/config.json": b"{}\n",
         "runs/conversions.json": b"[]\n"}


def test_packing_is_deterministic_and_unpacking_restores_every_file(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    make_runs(a, FILES)
    make_runs(b, dict(reversed(list(FILES.items()))))  # other creation order, other times and modes
    os.utime(b / "runs/mha-seed0/results.json", (1, 1))
    (b / "runs/sha-seed0/results.json").chmod(0o600)
    one, two = pack(a / "runs"), pack(b / "runs")
    assert one.read_bytes() == two.read_bytes() and not (a / "runs").exists()
    with tarfile.open(one, "r:xz") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(FILES)
    assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode, m.type) for m in members} == {
        (0, 0, 0, "", "", 0o644, tarfile.REGTYPE)}
    assert unpack(a / "runs") == a / "runs" and not one.exists()
    assert {str(p.relative_to(a)): p.read_bytes() for p in a.rglob("*") if p.is_file()} == FILES
    assert pack(a / "runs").read_bytes() == two.read_bytes()  # packed again: the same bytes


def test_runs_read_the_same_from_the_folder_and_from_the_archive(tmp_path):
    make_runs(tmp_path, FILES)
    loose = RunFiles(tmp_path)
    assert not loose.packed and loose.finished() == ["mha-seed0", "sha-seed0"]
    before = {n: (loose.results(n), loose.metrics(n), loose.config(n)) for n in loose.finished()}
    pack(tmp_path / "runs")
    packed = RunFiles(tmp_path)
    assert packed.packed and packed.finished() == ["mha-seed0", "sha-seed0"]
    assert {n: (packed.results(n), packed.metrics(n), packed.config(n)) for n in packed.finished()} == before
    assert before["mha-seed0"][1] == [{"step": 2}] and before["sha-seed0"][1] is None
    assert packed.where("mha-seed0", "results.json") == f"{tmp_path}/runs.tar.xz:runs/mha-seed0/results.json"


def test_refusals_leave_both_forms_as_they_were(tmp_path):
    make_runs(tmp_path, FILES)
    pack(tmp_path / "runs")
    archive = (tmp_path / "runs.tar.xz").read_bytes()
    (tmp_path / "runs").mkdir()
    with pytest.raises(MheError, match=r"holds both runs/ and runs.tar.xz; keep one"):
        RunFiles(tmp_path)
    with pytest.raises(MheError, match=r"runs exists already beside runs.tar.xz"):
        unpack(tmp_path / "runs")
    with pytest.raises(MheError, match=r"runs.tar.xz exists already; unpack it first"):
        pack(tmp_path / "runs")
    assert (tmp_path / "runs.tar.xz").read_bytes() == archive and not any((tmp_path / "runs").iterdir())
    (tmp_path / "runs" / "empty").mkdir()
    with pytest.raises(MheError, match=r"holds no files to pack"):
        pack(tmp_path / "runs" / "empty")
    with pytest.raises(MheError, match=r"nope is not a folder"):
        pack(tmp_path / "nope")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs", "runs.tar.xz"]
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["empty"]


def test_an_archive_member_outside_its_folder_is_refused(tmp_path):
    bad = tmp_path / "runs.tar.xz"
    bad.write_bytes(archive_bytes([("runs/../../evil.txt", b"x")]))
    with pytest.raises(MheError, match=r"member 'runs/../../evil.txt' is not a plain file inside the packed folder"):
        unpack(tmp_path / "runs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.tar.xz"]
    bad.write_bytes(b"not xz")
    with pytest.raises(MheError, match=r"runs.tar.xz: not a readable .tar.xz archive"):
        RunFiles(tmp_path)


def report(folder: Path, capsys) -> tuple[str, dict[str, bytes]]:
    """``mhe report FOLDER``'s printed table and the summary files it wrote."""
    capsys.readouterr()
    assert main(["report", str(folder)]) == 0
    return capsys.readouterr().out, {f: (folder / f).read_bytes() for f in SUMMARY}


@pytest.mark.parametrize("exp", ["lm-ptb", "llama-6x512"])
def test_report_from_a_committed_archive_equals_report_from_its_files(exp, tmp_path, capsys, monkeypatch):
    """The committed comparison reports the committed tables from its archive as it is, and the same
    after ``mhe report --unpack`` (plots are drawn by both and compared by their files too)."""
    src = RESULTS / exp
    if not src.exists():
        pytest.skip("no saved results in this checkout")
    folder = tmp_path / exp
    folder.mkdir()
    for f in ("sweep.json", "runs.tar.xz"):
        shutil.copy(src / f, folder / f)
    monkeypatch.chdir(tmp_path)
    packed = report(folder, capsys)
    plots = {p.name: p.read_bytes() for p in folder.glob("*.png")}
    assert {f: (src / f).read_bytes() for f in SUMMARY} == packed[1]  # what is committed beside the archive
    assert main(["report", "--unpack", str(folder)]) == 0
    assert "unpacked" in capsys.readouterr().out and not (folder / "runs.tar.xz").exists()
    assert (folder / "runs").is_dir()
    for p in folder.glob("*.png"):
        p.unlink()
    assert report(folder, capsys) == packed
    assert {p.name: p.read_bytes() for p in folder.glob("*.png")} == plots
    assert main(["report", "--pack", str(folder)]) == 0  # packed again: the committed bytes
    assert (folder / "runs.tar.xz").read_bytes() == (src / "runs.tar.xz").read_bytes()


def test_report_pack_and_unpack_bad_input_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="2"):
        main(["report", "--pack", "--unpack", str(tmp_path)])
    assert "argument --unpack: not allowed with argument --pack" in capsys.readouterr().err
    assert main(["report", "--unpack", str(tmp_path / "none")]) == 2
    assert "none.tar.xz does not exist (nothing packed there to unpack)" in capsys.readouterr().err
    assert main(["report", "--pack", "--metric", "accuracy", str(tmp_path)]) == 2
    assert "--paper and --metric go with a report" in capsys.readouterr().err


SMALL = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "train.batch_size=16", "train.steps=4",
         "train.save_every=4", "train.log_every=2",
         'data.task_options={"train_size": 64, "test_size": 16, "pairs": 4, "queries": 4}']


def test_a_packed_comparison_resumes_after_unpacking_and_records_no_machine_path(tmp_path, monkeypatch):
    """``mhe compare --resume`` on a packed comparison reports it and trains nothing; asked for
    more runs it names the way to unpack; unpacked, it trains only the missing run. The data folder,
    given as an absolute path inside the working folder, is recorded relative to it."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "cmp"
    given = str(tmp_path / "data")  # an absolute path, as a device's MHE_DATA often is
    one = Sweep("recall", "tiny-decoder", ["mha"], 1, data_dir=given, overrides=list(SMALL))
    first = run_sweep(one, out, workers=1, log=lambda m: None)
    record = json.loads((out / "runs/mha-seed0/config.json").read_text())
    assert record["run"]["data"]["data_dir"] == "data"
    pack(out / "runs")
    log = []
    assert run_sweep(one, out, workers=1, resume=True, log=log.append)["rows"] == first["rows"]
    assert log == [f"already finished: results in {out}/runs.tar.xz"] and not (out / "runs").exists()
    two = Sweep("recall", "tiny-decoder", ["mha"], 2, data_dir=given, overrides=list(SMALL))
    with pytest.raises(MheError, match=rf"^{out} is packed \(runs.tar.xz\) and 1 run\(s\) asked for are not finished "
                                       rf"in it \(mha-seed1\); unpack it first: mhe report --unpack {out}$"):
        run_sweep(two, out, workers=1, resume=True, log=log.append)
    unpack(out / "runs")
    log.clear()
    assert run_sweep(two, out, workers=1, resume=True, log=log.append)["rows"][0]["n_seeds"] == 2
    assert sum(m.startswith("[start]") for m in log) == 1  # the finished seed was not trained again


def test_the_data_folder_is_recorded_relative_to_the_working_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = default_run("recall", "tiny-decoder", "mha")
    cfg.data.data_dir = str(tmp_path / "data-cache" / "data")
    assert cfg.record()["data"]["data_dir"] == os.path.join("data-cache", "data")
    assert cfg.to_dict()["data"]["data_dir"] == str(tmp_path / "data-cache" / "data")  # the run reads it as given
    outside = str(tmp_path.parent / "elsewhere")
    assert portable_path(outside) == outside and portable_path("rel/data") == "rel/data" and portable_path("") == ""
    home = os.path.expanduser("~")  # not under the working folder (a temporary one)
    assert shown_path(os.path.join(home, ".cache", "mhe", "t.json")) == os.path.join("~", ".cache", "mhe", "t.json")


def test_no_committed_result_records_a_machine_path():
    """Every committed file under results/, and every member of its archives, is free of a
    machine's folders (a device's data folder, home, checkout or temporary folder)."""
    files = committed_files()
    if not files:
        pytest.skip("no saved results in this checkout")
    found = []
    for f in files:
        members = read_archive(f) if f.name.endswith(".tar.xz") else {"": f.read_bytes()}
        for name, data in members.items():
            found += [f"{f.relative_to(ROOT)}{':' + name if name else ''} holds {p.decode()}"
                      for p in MACHINE_PATHS if p in data]
    assert not found, "\n".join(found[:20])


def test_every_committed_experiment_keeps_its_runs_packed():
    """What a reader reads stays as files; the run folders are packed, one archive per experiment."""
    if not RESULTS.exists():
        pytest.skip("no saved results in this checkout")
    experiments = [d for d in RESULTS.iterdir() if (d / "RUN.md").is_file()]
    assert len(experiments) >= 30
    for d in experiments:
        assert not (d / "runs").exists(), f"{d.name}: runs/ not packed (mhe report --pack results/{d.name})"
        assert (d / "runs.tar.xz").is_file() and (d / "runs.tar.xz").stat().st_size < 5_000_000, d.name
        assert (d / "summary.md").is_file() and any(d.glob("*.png")), d.name
    assert len(committed_files()) < 400
    with tarfile.open(fileobj=io.BytesIO((RESULTS / "lm-ptb" / "runs.tar.xz").read_bytes()), mode="r:xz") as tar:
        assert len(tar.getnames()) > 90  # the run files are there, not dropped


def test_every_committed_run_loads_from_its_archive_and_keeps_its_hash():
    """Old run folders still load: every run configuration packed under results/ is read back by
    the current code to the hash it recorded (the scrubbed data folder is no part of it)."""
    from mhe.tasks import run_config_from_dict

    archives = sorted(RESULTS.glob("*/runs.tar.xz"))
    if not archives:
        pytest.skip("no saved results in this checkout")
    checked = 0
    for a in archives:
        files = RunFiles(a.parent)
        for name in sorted({n.split("/")[1] for n in read_archive(a) if n.endswith("/config.json")}):
            record = files.config(name)
            if "config_hash" in record:
                where = files.where(name, "config.json")
                assert run_config_from_dict(record["run"], source=where).hash() == record["config_hash"], where
                checked += 1
    assert checked > 600
