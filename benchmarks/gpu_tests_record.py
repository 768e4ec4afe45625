"""Write ``results/logs/gpu-tests.md``: every GPU test, run on one GPU and on two for one src tree.

    # on the GPU host, for each device set (one GPU, then two):
    CUDA_VISIBLE_DEVICES=0 python -m pytest -m gpu -o addopts="" -q -rs -p no:cacheprovider > gpu-tests-1gpu.log
    CUDA_VISIBLE_DEVICES=0,1 python -m pytest -m gpu -o addopts="" -q -rs -p no:cacheprovider > gpu-tests-2gpu.log
    # back here, on the commit whose src/ was sent:
    python benchmarks/gpu_tests_record.py ENV_TXT gpu-tests-1gpu.log gpu-tests-2gpu.log [--out results/logs/gpu-tests.md]

A two-GPU run that a call's time limit cut off may be finished in a later call by the node ids it
had not reached (pytest's collection order): pass both logs, in order, as the parts of the run.

``ENV_TXT`` holds what the host printed of itself (torch, transformers, the cards and a sha256 of
the sorted ``src/**/*.py`` files); the record states ``git rev-parse HEAD:src`` of this checkout
and refuses to write when the host's source hash differs from this checkout's, so the record
always describes the tree it names. Each log's first line is the command it ran (``+ ...``); the
record keeps its pytest summary line, every skip with pytest's reason (``-rs``) and every failure.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def src_sha() -> str:
    """sha256 over ``sha256sum``'s lines of the sorted ``src/**/*.py`` files (as the host computes it)."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "src").rglob("*.py"))
    lines = "".join(f"{hashlib.sha256((ROOT / f).read_bytes()).hexdigest()}  {f}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def section(log: Path, title: str) -> list[str]:
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("env", type=Path)
    ap.add_argument("one", type=Path, help="the log of the run on one GPU")
    ap.add_argument("two", type=Path, nargs="+",
                    help="the log of the run on two GPUs (or its parts, in order, where one call's time ran out)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "logs" / "gpu-tests.md")
    ap.add_argument("--how", default="Both runs ran at the same time on one host, on separate GPUs.",
                    help="how the two runs shared the host (a sentence for the record)")
    a = ap.parse_args()
    env = [ln for ln in a.env.read_text().splitlines() if not ln.startswith("src tree:")]  # the host's own git
    host_sha = next((ln.split(":", 1)[1].strip() for ln in env if ln.startswith("src sha256")), None)
    if host_sha != src_sha():
        print(f"gpu_tests_record: the host ran src/ with sha {host_sha}, this checkout's is {src_sha()}; "
              "record the run on the commit that was sent", file=sys.stderr)
        return 2
    tree = subprocess.run(["git", "rev-parse", "HEAD:src"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = ["# GPU tests on the device for main's src tree", "", f"src tree: {tree}", "",
            f"The host ran these `src/` files: their sha256 (below) equals this checkout's, {host_sha}.", "",
            "Host (as it printed itself):", "", "```"] + env + ["```", "",
            f"{a.how} Refresh this file whenever `src/` changes (`benchmarks/gpu_tests_record.py`).", ""]
    body = section(a.one, "One GPU")
    for k, log in enumerate(a.two, 1):
        body += section(log, "Two GPUs" + (f", part {k} of {len(a.two)}" if len(a.two) > 1 else ""))
    a.out.write_text("\n".join(head + body).rstrip() + "\n")
    print(f"wrote {a.out} (src tree {tree})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
