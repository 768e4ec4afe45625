"""The GPU record: every GPU test run at once over all GPUs of a host, and ``results/logs/gpu-tests.md``.

    # on the GPU host (one call; about 5 minutes on four H200s):
    python benchmarks/gpu_tests_record.py run --out $OUT
    # back here, on the commit whose src/ was sent, with the folder that came back:
    python benchmarks/gpu_tests_record.py adopt FOLDER

``run`` starts two pytest runs side by side and waits for both (each under a deadline):

* the one-card tests (``-m "gpu and not two_gpus"``), spread by pytest-xdist over every GPU of the
  host, ``--per-gpu`` workers a card (each worker sees its own card alone: ``MHE_GPU_SETS`` names
  the cards, ``tests/conftest.py`` sets ``CUDA_VISIBLE_DEVICES`` in each worker before CUDA starts);
* the two-card tests (``-m "gpu and two_gpus"``), one worker a pair of cards.

It writes into ``--out`` the two logs (each opening with its command, ``+ ...``, and closing with
``exit N after S s``), ``env.txt`` (torch, transformers, the cards and a sha256 of the sorted
``src/**/*.py`` files) and ``gpu-tests.md``, the record with the call's wall time. ``adopt``
checks that this checkout's ``src`` has the sha256 the host ran, names ``git rev-parse HEAD:src``,
and writes the record and the logs under ``results/logs/`` (it refuses a run of other files).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from toolbox import ROOT  # noqa: E402
LOGS = ("gpu-tests-one-card.log", "gpu-tests-two-cards.log")
PYTEST = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-rs", "-p", "no:cacheprovider", "--durations=20"]


def src_sha(root: Path = ROOT) -> str:
    """sha256 over ``sha256sum``'s lines of the sorted ``src/**/*.py`` files (the same on either machine)."""
    files = sorted(str(p.relative_to(root)) for p in (root / "src").rglob("*.py"))
    lines = "".join(f"{hashlib.sha256((root / f).read_bytes()).hexdigest()}  {f}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- reading logs
def section(log: Path, title: str) -> list[str]:
    """The record's section of one log: its command, pytest's summary (or a killed run's progress),
    its exit line, every failure and every skip with pytest's reason."""
    text = []
    for ln in log.read_text(errors="replace").splitlines():  # a killed run's last progress line and the
        m = re.match(r"^(.+?)(exit \d+ after \d+ s)$", ln)  # script's exit line can share a line
        text += [m.group(1), m.group(2)] if m else [ln]
    command = text[0][2:] if text and text[0].startswith("+ ") else "(command not recorded)"
    summary = [ln for ln in text if re.match(r"^=*\s*\d+ (passed|failed)", ln.strip("= ")) or
               re.search(r"\d+ (passed|failed|error)", ln) and " in " in ln]
    skips = [ln for ln in text if ln.startswith("SKIPPED")]
    failed = [ln for ln in text if ln.startswith(("FAILED", "ERROR"))] or [
        m.group(1) for ln in text if (m := re.match(r"^_{3,} (test\S*) _{3,}$", ln))]  # -rs lists skips only
    ended = [ln for ln in text if ln.startswith("exit ")]
    out = [f"## {title}", "", "```bash", command, "```", "",
           f"Summary: `{summary[-1].strip('= ') if summary else unfinished(text)}`"
           + (f" ({ended[-1]})" if ended else ""), ""]
    if failed:
        out += ["Failures:", ""] + [f"* `{ln}`" for ln in failed] + [""]
    if skips:
        out += ["Skipped, with pytest's reason:", ""] + [f"* `{ln}`" for ln in skips] + [""]
    return out


def unfinished(text: list[str]) -> str:
    """What a run cut off before pytest's summary line shows: its progress marks (``-q``), one a test."""
    marks = "".join(m.group(1) for ln in text if (m := re.match(r"^([.FEsxX]+)(?:\s+\[\s*\d+%\])?$", ln)))
    counts = {name: marks.count(c) for c, name in ((".", "passed"), ("F", "failed"), ("E", "error"),
                                                    ("s", "skipped"), ("x", "xfailed"), ("X", "xpassed"))}
    done = ", ".join(f"{n} {name}" for name, n in counts.items() if n)
    return f"no summary line (the run did not finish); progress marks before it ended: {done or 'none'}"


def passed(log: Path) -> bool:
    """The run ended with exit 0 (every selected test passed or was skipped)."""
    return bool(re.search(r"exit 0 after \d+ s\s*$", log.read_text(errors="replace")))


def record(env: list[str], logs: list[tuple[Path, str]], how: str, tree: str | None = None) -> str:
    """The text of ``gpu-tests.md``: the host, how the runs shared it, and each log's section."""
    sha = next((ln.split(":", 1)[1].strip() for ln in env if ln.startswith("src sha256")), "?")
    head = ["# GPU tests on the device for main's src tree", ""]
    head += [f"src tree: {tree}", ""] if tree else []
    head += [f"The host ran the `src/` files whose sha256 is {sha}.", "", "Host (as it printed itself):", "",
             "```"] + env + ["```", "", how, "",
             "Refresh this file whenever `src/` changes: `python benchmarks/gpu_tests_record.py run --out DIR` on "
             "the GPU host, then `python benchmarks/gpu_tests_record.py adopt DIR` here.", ""]
    body = []
    for log, title in logs:
        body += section(log, title)
    return "\n".join(head + body).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------- running
def host_lines(cards: int) -> list[str]:
    """What the host says of itself: versions, the cards, the sha256 of the src files it runs."""
    import torch

    try:
        import transformers
        hf = transformers.__version__
    except ImportError:
        hf = "not installed"
    names = {torch.cuda.get_device_name(i) for i in range(cards)}
    lines = [f"torch {torch.__version__} transformers {hf} python {sys.version.split()[0]}",
             f"cards {cards} x {', '.join(sorted(names)) or 'none'}",
             f"src sha256 (sorted .py files): {src_sha()}"]
    return lines


def plan(cards: int, per_gpu: int) -> list[tuple[str, str, int, str]]:
    """(log name, pytest marker expression, workers, MHE_GPU_SETS) of the runs that share the host."""
    singles = ";".join(str(i) for i in range(cards))
    runs = [(LOGS[0], "gpu and not two_gpus", max(1, cards * per_gpu), singles)]
    if cards >= 2:
        pairs = ";".join(f"{2 * i},{2 * i + 1}" for i in range(cards // 2))
        runs.append((LOGS[1], "gpu and two_gpus", cards // 2, pairs))
    return runs


def start(log: Path, marker: str, workers: int, sets: str) -> tuple[subprocess.Popen, float]:
    """One pytest run in a session of its own (so a deadline ends it and every process it started),
    with ``CI`` set: a test whose benchmark data is missing fails the record, not skips (a record
    once passed with two such tests skipped, the data not carried to the host)."""
    command = PYTEST + ["-m", marker, "-n", str(workers)]
    fh = log.open("w")
    fh.write(f"+ CI=true MHE_GPU_SETS='{sets}' python {' '.join(command[1:])}\n")
    fh.flush()
    env = {**os.environ, "CI": "true", "MHE_GPU_SETS": sets, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(command, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, time.monotonic()


def wait_all(runs: list[tuple[Path, subprocess.Popen, float]], deadline: float) -> None:
    """Wait for every run; past ``deadline`` (seconds from now) end the ones left (SIGTERM, then
    SIGKILL) so the call still returns its logs. Each log closes with ``exit N after S s``."""
    end = time.monotonic() + deadline
    left = list(runs)
    while left:
        time.sleep(2)
        for run in list(left):
            log, proc, began = run
            code = proc.poll()
            if code is None and time.monotonic() > end:
                stop(proc)
                code = 124
            if code is not None:
                with log.open("a") as fh:
                    fh.write(f"\nexit {code} after {round(time.monotonic() - began)} s\n")
                left.remove(run)


def stop(proc: subprocess.Popen) -> None:
    """End ``proc``'s session: SIGTERM, and SIGKILL for what is left after 10 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
            if sig == signal.SIGTERM:
                os.killpg(proc.pid, signal.SIGKILL)  # workers that outlived their parent
        except (subprocess.TimeoutExpired, ProcessLookupError):
            continue
        return


def how_shared(cards: int, per_gpu: int, wall: int) -> str:
    """The record's sentence on how the runs shared the host (and what a one-card host could not run)."""
    if cards < 2:
        return (f"One call on a host of one card: the one-card tests ({per_gpu} pytest-xdist workers on it). The "
                "two-card tests (marker `two_gpus`) need two cards and did not run on this host. "
                f"Wall time of the whole suite: {wall} s.")
    return (f"One call on a host of {cards} cards: the runs below ran at the same time, the one-card tests over "
            f"all {cards} cards ({per_gpu} pytest-xdist workers a card), the two-card tests one worker a pair. "
            f"Wall time of the whole suite: {wall} s.")


def cmd_run(a) -> int:
    import torch

    cards = torch.cuda.device_count()
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    env = host_lines(cards)
    (out / "env.txt").write_text("\n".join(env) + "\n")
    began = time.monotonic()
    runs = []
    for name, marker, workers, sets in plan(cards, a.per_gpu):
        proc, t0 = start(out / name, marker, workers, sets)
        runs.append((out / name, proc, t0))
    wait_all(runs, a.deadline)
    wall = round(time.monotonic() - began)
    how = how_shared(cards, a.per_gpu, wall)
    logs = [(path, title) for (path, _, _), title in zip(runs, ("One card each", "Two cards each"))]
    (out / "gpu-tests.md").write_text(record(env, logs, how))
    ok = all(passed(path) for path, _, _ in runs)
    print(f"gpu tests: {'all passed' if ok else 'FAILURES or unfinished runs'} in {wall} s; record in {out}")
    return 0 if ok else 1


def rebuilt(folder: Path, env: list[str]) -> str:
    """The record's page from its logs and ``env.txt`` alone, where the page itself did not come back
    (a device call returns a limited number of files): the wall time is the one-card run's own."""
    logs = [(folder / name, title) for name, title in zip(LOGS, ("One card each", "Two cards each"))
            if (folder / name).is_file()]
    walls = [re.search(r"exit \d+ after (\d+) s\s*$", log.read_text(errors="replace")) for log, _ in logs]
    wall = max((int(w.group(1)) for w in walls if w), default=0)
    cards = next((int(m.group(1)) for m in map(re.compile(r"cards (\d+) x").match, env) if m), 0)
    how = (f"One call on a host of {cards} card(s); this page was rebuilt here from the run's logs (its own "
           f"page did not come back from the host). The longest run took {wall} s."
           + (" The two-card tests (marker `two_gpus`) need two cards and did not run." if cards < 2 else ""))
    return record(env, logs, how)


def cmd_adopt(a) -> int:
    folder = a.folder
    env = (folder / "env.txt").read_text().splitlines()
    host = next((ln.split(":", 1)[1].strip() for ln in env if ln.startswith("src sha256")), None)
    if host != src_sha():
        print(f"gpu_tests_record: the host ran src/ with sha256 {host}, this checkout's is {src_sha()}; "
              "adopt the run on the commit whose tree was sent", file=sys.stderr)
        return 2
    page = folder / "gpu-tests.md"
    text = page.read_text() if page.is_file() else rebuilt(folder, env)
    tree = subprocess.run(["git", "rev-parse", "HEAD:src"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    text = text.replace("# GPU tests on the device for main's src tree\n\n",
                        f"# GPU tests on the device for main's src tree\n\nsrc tree: {tree}\n\n", 1)
    a.out.write_text(text)
    logs = a.out.parent / "gpu-tests"
    logs.mkdir(exist_ok=True)
    for name in LOGS + ("env.txt",):
        if (folder / name).is_file():
            shutil.copyfile(folder / name, logs / name)
    print(f"wrote {a.out} (src tree {tree}) and the logs in {logs}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="on the GPU host: run every GPU test over all its cards at once")
    run.add_argument("--out", type=Path, required=True, help="folder for the logs, env.txt and gpu-tests.md")
    run.add_argument("--per-gpu", type=int, default=2, help="pytest-xdist workers a card for one-card tests")
    run.add_argument("--deadline", type=float, default=540, help="seconds before unfinished runs are ended")
    adopt = sub.add_parser("adopt", help="here: check the host's src sha256 and write the record")
    adopt.add_argument("folder", type=Path)
    adopt.add_argument("--out", type=Path, default=ROOT / "results" / "logs" / "gpu-tests.md")
    a = ap.parse_args(argv)
    if a.cmd == "run" and a.per_gpu < 1:
        ap.error(f"--per-gpu must be at least 1, got {a.per_gpu}")
    return cmd_run(a) if a.cmd == "run" else cmd_adopt(a)


if __name__ == "__main__":
    sys.exit(main())
