"""The pooled workers' queue and console (``mhe.experiments.pool``): jobs handed out only when
admitted, and lines logged from several worker threads at once each arrive whole."""

import threading
import time
from pathlib import Path

from mhe.experiments.pool import Pool, PoolJob, Queue


def test_lines_from_concurrent_workers_do_not_run_together():
    """A writer that, like ``print``, writes a line's text and its newline apart (with a pause
    between, so threads overlap): through ``Pool.log`` every line comes out whole. Without the
    lock, 8 threads of 20 lines give lines such as ``[start] A[start] B`` and empty ones."""
    out: list[str] = []

    def slow_print(line):
        out.append(line)
        time.sleep(0.001)
        out.append("\n")

    pool = Pool(8, log=slow_print)
    threads = [threading.Thread(target=lambda i=i: [pool.log(f"[start] run-{i}-{j}") for j in range(20)])
               for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = "".join(out).splitlines()
    assert len(lines) == 160 and sorted(lines) == sorted(f"[start] run-{i}-{j}" for i in range(8) for j in range(20))


def test_the_queue_hands_out_only_admitted_jobs_and_leaves_the_rest_waiting():
    """With ``admit``, a worker gets the first waiting job it admits (not the first waiting), and
    None when it admits none, though jobs still wait: they stay in ``pending`` for the next call.
    Without ``admit`` the order is the queue's."""
    jobs = [PoolJob(n, Path(n), None) for n in ("long", "short", "longer")]
    q = Queue(jobs, admit=lambda j: j.name == "short")
    got = q.take()
    assert got.name == "short" and q.running == 1
    q.done(got, 0)
    assert q.take() is None and [j.name for j in q.pending] == ["long", "longer"] and q.running == 0
    plain = Queue([PoolJob(n, Path(n), None) for n in ("a", "b")])
    assert [plain.take().name, plain.take().name] == ["a", "b"]


def test_a_worker_that_may_take_nothing_waits_while_a_run_can_still_add_work():
    """Only a run the deadline would cut is waiting, but a run still going adds work when it ends
    (a finished sweep's seeds): a second worker waits for that work instead of ending, and ends
    once nothing it may take is left and nothing runs."""
    first = PoolJob("sweep", Path("sweep"), None)
    seeds = [PoolJob(f"seed{i}", Path(f"seed{i}"), None) for i in (1, 2)]
    q = Queue([first, PoolJob("long", Path("long"), None)], on_done=lambda j, rc: seeds if j is first else [],
              admit=lambda j: j.name != "long")
    running = q.take()
    got = []
    second = threading.Thread(target=lambda: got.append(q.take()))
    second.start()
    time.sleep(0.05)
    assert second.is_alive() and not got  # waiting, not ended
    q.done(running, 0)
    second.join(2)
    assert [j.name for j in got] == ["seed1"]
    q.done(got[0], 0)
    last = q.take()
    q.done(last, 0)
    assert last.name == "seed2" and q.take() is None and [j.name for j in q.pending] == ["long"]
