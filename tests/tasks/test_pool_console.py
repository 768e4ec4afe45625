"""The pooled workers' console (``mhe.experiments.pool``): lines logged from several worker
threads at once each arrive whole."""

import threading
import time

from mhe.experiments.pool import Pool


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
