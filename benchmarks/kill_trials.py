"""Kill training at random moments and check that nothing is lost (issue 63).

Each trial starts a small ``mhe train`` run (the synthetic recall task: no data files; a
checkpoint every step), and sends it SIGKILL, SIGTERM or SIGINT once checkpoint K (drawn
uniformly over the run) exists: at once or up to 50 ms later (``random``; K = 0: a random moment
of the start-up), or as soon as the next checkpoint write has begun, its temporary folder there
(``write``). It then resumes the run with ``--resume`` until it finishes, as a user would.
The trial passes when

* every checkpoint folder the kill left under ``checkpoints/`` is sealed and whole (a torn one
  would be named ``step-N`` without a valid manifest), and the resume sets none of them aside: it
  goes on from the newest (a resume that refuses whole checkpoints starts over, and since a
  restart repeats the losses, only this check sees the steps lost);
* no worker outlives its launcher by more than a minute (a signalled worker saves and exits);
* the resumed run's ``metrics.jsonl`` holds every step once, and each step's loss and gradient
  norm equal the uninterrupted reference run's (bit for bit when two uninterrupted runs agree bit
  for bit, as on the CPU; else within the larger of their own run-to-run gap and ``--tol``);
* its final weights equal the reference's to the same rule.

Setups: ``single`` (one process), ``ddp`` and ``fsdp`` (``torchrun --nproc-per-node N``, gloo
on the CPU, NCCL with ``--device cuda``); a signal goes to the launcher and every worker (a job
scheduler's SIGTERM to the job, a lost node; torchrun's workers run in sessions of their own).
One JSON line per trial goes to ``WORK/trials.jsonl`` and a summary of all of them is printed.
A call again with the same ``--work`` continues to ``--trials`` in all (``--deadline`` stops a
call that must end in time, exit 3)::

    python benchmarks/kill_trials.py --trials 100 --setups single,ddp,fsdp --work DIR
    python benchmarks/kill_trials.py --trials 20 --setups fsdp --nproc 2 --device cuda --work DIR \\
        --set train.compile=false
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from toolbox import ROOT  # noqa: E402
SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGINT": signal.SIGINT}
MOMENTS = ("random", "write")  # a uniform moment of the run, or just after a checkpoint write began
RUN_LIMIT_S = 300
CLOCK = time.monotonic  # the clock of --deadline (a test replaces it)


EXTRA: list[str] = []  # --set items of the command line, added to every run


def run_args(out: Path, steps: int, device: str, setup: str) -> list[str]:
    """``mhe train`` arguments of the trials' run: a checkpoint every step, so kills land in writes
    (and the ``--set`` items given to this script, e.g. ``train.compile=false``)."""
    items = ["model.d_model=32", "model.d_ff=64", "model.n_layers=1", "model.dropout=0", "model.attn_dropout=0",
             'data.task_options={"train_size": 256, "test_size": 16, "pairs": 4, "queries": 4}',
             "train.batch_size=16", f"train.steps={steps}", "train.log_every=1", "train.save_every=1",
             "train.keep_last=3", "train.eval_every=0", "train.progress=false", "train.warmup_steps=2",
             "train.lr=3e-3", f"train.device={device}", "train.keep_checkpoints=true"]
    if setup != "single":
        items.append(f"train.parallel={setup}")
    items += EXTRA
    sets = [a for item in items for a in ("--set", item)]
    return ["train", "--task", "recall", "--preset", "tiny-decoder", "--attention", "mhe-mul", "--out", str(out), *sets]


def command(setup: str, nproc: int) -> list[str]:
    """The launcher: ``python -m mhe`` for one process, ``torchrun`` for ``ddp``/``fsdp``."""
    if setup == "single":
        return [sys.executable, "-m", "mhe"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "mhe"]


def environment() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", MHE_THREADS="1", PYTHONUNBUFFERED="1")


def start(args: list[str], setup: str, nproc: int, log: Path) -> subprocess.Popen:
    with open(log, "a") as f:
        return subprocess.Popen(command(setup, nproc) + args, stdout=f, stderr=subprocess.STDOUT, env=environment(),
                                start_new_session=True, cwd=ROOT)


def finish(proc: subprocess.Popen, limit_s: float = RUN_LIMIT_S) -> int:
    """The exit status; a run past ``limit_s`` is killed (status -9) and counted as a hang."""
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return -9


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def final_weights(out: Path, steps: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "checkpoints" / f"step-{steps:08d}" / "model.safetensors"))


def reference(work: Path, setup: str, nproc: int, steps: int, device: str, copies: int = 2) -> tuple[list, float]:
    """Uninterrupted runs of ``setup`` (cached in ``work``): (their folders, mean wall seconds)."""
    outs, walls = [], []
    for i in range(copies):
        out = work / f"reference-{setup}-{i}"
        stamp = out / "wall_s.txt"
        if not stamp.exists():
            shutil.rmtree(out, ignore_errors=True)
            t0 = time.monotonic()
            code = finish(start(run_args(out, steps, device, setup), setup, nproc, work / f"reference-{setup}-{i}.log"))
            if code != 0:
                raise SystemExit(f"the uninterrupted {setup} run failed (exit {code}); see {out}.log")
            stamp.write_text(str(time.monotonic() - t0))
        outs.append(out)
        walls.append(float(stamp.read_text()))
    return outs, sum(walls) / len(walls)


def gap(a, b) -> float:
    """The largest absolute difference of two numbers, lists of records or dicts of tensors."""
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return math.inf
        return max((float((a[k].double() - b[k].double()).abs().max()) for k in a), default=0.0)
    return max((abs(x[key] - y[key]) for x, y in zip(a, b) for key in ("loss", "grad_norm")), default=0.0)


def progress(out: Path) -> int:
    """The newest checkpoint's step (one is saved every step), -1 before the first."""
    names = [p.name for p in _folders(out / "checkpoints")]
    steps = [int(n[5:]) for n in names if n.startswith("step-") and n[5:].isdigit()]
    return max(steps, default=-1)


def writing(out: Path) -> bool:
    """Whether a checkpoint write is under way (its temporary folder is there)."""
    return any(p.name.startswith(".tmp-") for p in _folders(out / "checkpoints"))


def wait_for_moment(proc: subprocess.Popen, out: Path, moment: str, after: int, wall_s: float,
                    rng: random.Random) -> None:
    """Return at the kill's moment: once checkpoint ``after`` exists (``after`` 0: a random moment
    of the start-up, before any), then at once plus up to a step's time (``random``) or as soon
    as the next checkpoint write has begun (``write``)."""
    if after == 0 and moment == "random":
        time.sleep(rng.uniform(0.0, 0.9) * wall_s)
        return
    while after and proc.poll() is None and progress(out) < after:
        time.sleep(0.001)
    if moment == "random":
        time.sleep(rng.uniform(0.0, 0.05))
        return
    while proc.poll() is None and not writing(out):
        time.sleep(0.0002)
    time.sleep(rng.uniform(0.0, 0.005))


def processes(root: int) -> list[int]:
    """``root`` and every process below it (the launcher's workers run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def kill(proc: subprocess.Popen, sig: str) -> list[int]:
    """Send ``sig`` to the launcher and every worker (a scheduler's signal to the job, a lost
    node); returns the processes signalled (empty: the run had finished first)."""
    if proc.poll() is not None:
        return []
    pids = processes(proc.pid)
    for pid in pids:
        try:
            os.kill(pid, SIGNALS[sig])
        except ProcessLookupError:
            pass
    return pids


def stragglers(pids: list[int], limit_s: float = 60.0) -> int:
    """How many of ``pids`` are still alive ``limit_s`` after the launcher ended (a worker left
    hanging); those are killed, so that none writes into the folder the resume uses."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return len(left)


def _folders(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []


def left_checkpoints(out: Path) -> tuple[int, int]:
    """(sealed checkpoints, torn ones) under ``out/checkpoints`` as the kill left them."""
    from mhe.training.atomic import verify

    named = [p for p in _folders(out / "checkpoints") if p.name.startswith("step-") and "." not in p.name]
    torn = [p for p in named if verify(p) is not None]
    return len(named) - len(torn), len(torn)


def resume(out: Path, setup: str, nproc: int, steps: int, device: str, log: Path) -> int:
    """``--resume`` to the end; a run killed before its folder held a configuration starts afresh."""
    args = run_args(out, steps, device, setup)
    if (out / "config.json").exists():
        args.append("--resume")
    else:
        shutil.rmtree(out, ignore_errors=True)
    return finish(start(args, setup, nproc, log))


def trial(i: int, work: Path, setup: str, opts, refs: list, wall_s: float, tol: float, rng: random.Random) -> dict:
    """One kill and resume; the record of what happened and whether anything was lost."""
    sig, moment, after = rng.choice(sorted(SIGNALS)), rng.choice(MOMENTS), rng.randrange(opts.steps - 1)
    out, log = work / f"trial-{i:03d}-{setup}", work / f"trial-{i:03d}-{setup}.log"
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.monotonic()
    proc = start(run_args(out, opts.steps, opts.device, setup), setup, opts.nproc, log)
    wait_for_moment(proc, out, moment, after, wall_s, rng)
    at, in_write, pids = time.monotonic() - t0, writing(out), kill(proc, sig)
    killed_code = finish(proc)
    hung = stragglers(pids)
    sealed, torn = left_checkpoints(out)
    steps_logged = len(records(out))
    code = resume(out, setup, opts.nproc, opts.steps, opts.device, log)
    got, want = records(out), records(refs[0])
    complete = code == 0 and [r["step"] for r in got] == list(range(1, opts.steps + 1))
    loss_gap = gap(got, want) if complete else math.inf
    weight_gap = gap(final_weights(out, opts.steps), final_weights(refs[0], opts.steps)) if complete else math.inf
    rejected = sum(1 for p in _folders(out / "checkpoints") if ".rejected-" in p.name)
    row = {"trial": i, "setup": setup, "nproc": 1 if setup == "single" else opts.nproc, "device": opts.device,
           "signal": sig, "moment": moment, "after_checkpoint": after, "at_s": round(at, 3) if pids else -1.0,
           "write_under_way": in_write, "killed_exit": killed_code, "hung_workers": hung,
           "steps_logged_at_kill": steps_logged, "sealed_left": sealed, "torn_left": torn, "set_aside": rejected,
           "resume_exit": code, "complete": complete, "loss_gap": loss_gap, "weight_gap": weight_gap,
           "tolerance": tol}
    row["ok"] = ok = passed(row)
    if ok and not opts.keep:
        shutil.rmtree(out, ignore_errors=True)
    return row


def passed(row: dict) -> bool:
    """Nothing lost: the resume finished with every step once (rows without ``complete``: their
    gaps finite), each loss, gradient norm and weight within the tolerance, no worker left
    hanging and no checkpoint set aside."""
    complete = row.get("complete", math.isfinite(row["loss_gap"]) and math.isfinite(row["weight_gap"]))
    return (complete and row["resume_exit"] == 0 and row["loss_gap"] <= row["tolerance"]
            and row["weight_gap"] <= row["tolerance"] and row["hung_workers"] == 0 and row["set_aside"] == 0)


def summary(rows: list[dict]) -> str:
    """Counts per setup and signal: trials, kills that landed (the run not yet finished), those
    during a checkpoint write, torn checkpoints left, checkpoints a resume set aside, workers left
    hanging, passes, the largest gaps."""
    lines = ["| setup | signal | trials | landed | in a write | torn left | set aside | hung | passed | max loss gap "
             "| max weight gap |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for setup in sorted({r["setup"] for r in rows}):
        for sig in sorted(SIGNALS):
            rs = [r for r in rows if r["setup"] == setup and r["signal"] == sig]
            if not rs:
                continue
            landed = [r for r in rs if r["at_s"] >= 0]
            counts = (len(rs), len(landed), sum(r["write_under_way"] for r in landed), sum(r["torn_left"] for r in rs),
                      sum(r["set_aside"] for r in rs), sum(r["hung_workers"] for r in rs), sum(r["ok"] for r in rs))
            lines.append(f"| {setup} | {sig} | " + " | ".join(map(str, counts))
                         + f" | {max(r['loss_gap'] for r in rs):.3g} | {max(r['weight_gap'] for r in rs):.3g} |")
    return "\n".join(lines)


def earlier_trials(work: Path) -> list[dict]:
    """The rows a previous call left in ``WORK/trials.jsonl`` (a call continues their count), each
    judged again by :func:`passed` (a row of an older harness may have passed by weaker checks).
    A line cut short by a killed call is reported and left out."""
    path, rows = work / "trials.jsonl", []
    for n, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        try:
            row = json.loads(line)
        except ValueError:
            print(f"{path}:{n}: not a JSON row (a write cut short?); left out")
            continue
        rows.append({**row, "ok": passed(row)})
    return rows


def run_trials(opts, work: Path, setups: list[str], refs: dict, first: int, started: float) -> list[dict]:
    """Trials ``first`` to ``opts.trials - 1``, each row appended to ``trials.jsonl`` as it ends.
    With ``--deadline`` no trial starts unless it would end in time were it as long as the longest
    so far or two and a half reference runs, whichever is longer. The draws of a continued call
    are seeded by the seed and the trial it starts at, so that it does not repeat the first call's
    signals and moments."""
    rng, rows, longest = random.Random(opts.seed if first == 0 else f"{opts.seed}+{first}"), [], 0.0
    with open(work / "trials.jsonl", "a") as f:
        for i in range(first, opts.trials):
            s = setups[i % len(setups)]
            outs, wall, tol = refs[s]
            if opts.deadline and CLOCK() - started + max(longest, 2.5 * wall) > opts.deadline:
                print(f"deadline: {i - first} trial(s) this call; run again with the same --work to continue")
                break
            t0 = CLOCK()
            row = trial(i, work, s, opts, outs, wall, tol, rng)
            longest = max(longest, CLOCK() - t0)
            rows.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print(json.dumps(row), flush=True)
    return rows


def main(argv=None) -> int:
    started = CLOCK()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=100, help="trials in all, counting those already in WORK")
    p.add_argument("--setups", default="single,ddp,fsdp", help="comma-separated: single, ddp, fsdp (taken in turn)")
    p.add_argument("--nproc", type=int, default=2, help="processes of a ddp/fsdp run (torchrun)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--tol", type=float, default=0.0, help="allowed gap beyond two uninterrupted runs' own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", required=True, help="folder for the runs and trials.jsonl (a rerun continues it)")
    p.add_argument("--deadline", type=float, default=0.0, help="seconds: start no trial that would end later "
                   "(exit 3 if trials remain)")
    p.add_argument("--keep", action="store_true", help="keep the run folders of passed trials")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting for every run")
    opts = p.parse_args(argv)
    EXTRA[:] = opts.set
    setups = opts.setups.split(",")
    if not set(setups) <= {"single", "ddp", "fsdp"} or opts.trials < 1 or opts.nproc < 1 or opts.deadline < 0:
        p.error(f"--setups takes single, ddp, fsdp (got {opts.setups}); --trials and --nproc positive, "
                f"--deadline not negative (got {opts.deadline})")
    work = Path(opts.work)
    work.mkdir(parents=True, exist_ok=True)
    refs = {}
    for s in setups:
        outs, wall = reference(work, s, opts.nproc, opts.steps, opts.device)
        noise = max(gap(records(outs[0]), records(outs[1])),
                    gap(final_weights(outs[0], opts.steps), final_weights(outs[1], opts.steps)))
        refs[s] = (outs, wall, max(noise, opts.tol))
    earlier = earlier_trials(work)
    rows = earlier + run_trials(opts, work, setups, refs, len(earlier), started)
    print(summary(rows))
    print(f"{len(rows)} trial(s) in {work / 'trials.jsonl'}, {len(earlier)} from earlier calls; tolerance per "
          "setup (two uninterrupted runs' own gap, or --tol): " + ", ".join(f"{s} {refs[s][2]:.3g}" for s in setups))
    if not all(r["ok"] for r in rows):
        return 1
    return 3 if len(rows) < opts.trials else 0


if __name__ == "__main__":
    sys.exit(main())
