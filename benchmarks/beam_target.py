"""Beam search's open target in one call: a trained transformer-base on Multi30k test 2016 (1,000
sentences, beam 4), this tree against an older one, identical output in fp32.

    python benchmarks/beam_target.py OUT --data-dir DATA --old-src OLD/src [--steps 1000] [--profile]

Trains the run both trees can build (``mhe train-mt``, transformer-base MHA with GELU and
LayerNorm epsilon 1e-5, vocabulary 8,000, ``--steps`` steps: 1,000 as in docs/benchmarks.md
section 6; fewer give a weaker model whose translations loop to ``max_len`` more often), exports
it (``beam_speed.py --run --export``), decodes the test set twice in each tree through its own
``TranslationTask.translate`` (this tree: fp32, then ``--dtype bfloat16``; the older tree in
batches of ``--old-batch`` as its runs did), and compares (identical hypotheses, first and warm
passes, BLEU). ``--profile`` adds ``profile_beam_pass.py`` (where a warm fp32 pass's time goes).
Every command and its output go to ``OUT/beam-target.md``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
SRC = HERE.parent / "src"


def train_command(out: Path, data_dir: str, steps: int, preset: str, vocab: int) -> list[str]:
    sets = ["model.activation=gelu", "model.layer_norm_eps=1e-5", f"data.vocab_size={vocab}", f"train.steps={steps}",
            f"train.warmup_steps={min(600, max(1, steps * 3 // 5))}", f"train.eval_every={steps}",
            f"train.save_every={steps}", "train.progress=false",
            'data.task_options={"max_tokens": 8192, "eval_sentences": 300}']
    return [sys.executable, "-m", "mhe", "train-mt", "--preset", preset, "--attention", "mha",
            "--data-dir", data_dir, "--out", str(out)] + [x for s in sets for x in ("--set", s)]


class Log:
    def __init__(self, out: Path) -> None:
        self.out, self.lines, self.start = out, [], time.perf_counter()

    def run(self, cmd: list[str], src: Path, label: str) -> str:
        """Run ``cmd`` with ``src`` on PYTHONPATH; its output is logged and returned."""
        env = {**os.environ, "PYTHONPATH": str(src.resolve())}
        t0 = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t0
        text = (done.stdout + ("" if done.returncode == 0 else done.stderr[-3000:])).strip()
        shown = " ".join(c if " " not in c else repr(c) for c in cmd[1:])
        self.lines += [f"### {label} ({took:.0f} s{'' if done.returncode == 0 else ', FAILED'})", "",
                       f"    PYTHONPATH={src} python {shown}", "", "```", text[-4000:], "```", ""]
        print(f"[{time.perf_counter() - self.start:5.0f} s] {label}: {took:.0f} s, exit {done.returncode}", flush=True)
        self.save()
        return text if done.returncode == 0 else ""

    def save(self) -> None:
        (self.out / "beam-target.md").write_text("\n".join(["# Beam search target (issue 28)", ""] + self.lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--data-dir", default=os.environ.get("MHE_DATA", ""))
    ap.add_argument("--old-src", default="")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--old-batch", type=int, default=64)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--preset", default="transformer-base", help="tiny-encoder-decoder checks the flow on a CPU")
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--sentences", type=int, default=1000, help="decode the first N test sentences")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log, speed, few = Log(out), str(HERE / "beam_speed.py"), ["--sentences", str(a.sentences)]
    if (out / "beam-run" / "results.json").exists():  # a finished run from an earlier call: reused
        log.lines += [f"### train: reusing the finished run in {out / 'beam-run'}", ""]
    elif not log.run(train_command(out / "beam-run", a.data_dir, a.steps, a.preset, a.vocab), SRC,
                     f"train {a.steps} steps"):
        return
    mt = str(out / "mt.pt")
    log.run([sys.executable, speed, "--run", str(out / "beam-run"), "--export", mt], SRC, "export")
    log.run([sys.executable, speed, "--weights", mt, "--out", str(out / "new.pt")] + few, SRC, "this tree, fp32")
    log.run([sys.executable, speed, "--weights", mt, "--out", str(out / "new-bf16.pt"), "--dtype", "bfloat16"] + few,
            SRC, "this tree, bf16")
    if a.old_src:
        old = Path(a.old_src)
        log.run([sys.executable, speed, "--weights", mt, "--out", str(out / "old.pt"), "--batch", str(a.old_batch)]
                + few, old, f"older tree, fp32, batches of {a.old_batch}")
        for name in ("new", "new-bf16"):
            log.run([sys.executable, speed, "--compare", str(out / f"{name}.pt"), str(out / "old.pt")], SRC,
                    f"compare {name} with the older tree")
    if a.profile:
        log.run([sys.executable, str(HERE / "profile_beam_pass.py"), mt], SRC, "profile of a warm fp32 pass")


if __name__ == "__main__":
    main()
