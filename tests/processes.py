"""The launcher of the tests that train on two CPU processes (gloo): ``mp.spawn`` with a watchdog
in every worker.

A worker that hangs (a gloo process group torn down while one of its threads waits for the GIL,
or inductor's compile workers under distributed work: docs/dev-notes.md) prints every thread's
stack to standard error and exits with status 1 after ``limit_s``. The test then fails in minutes
and names the line it hung on, where ``mp.spawn(join=True)`` would wait until CI's own limit
(a clean-clone CI run was cut off that way, with no trace of where).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
from typing import Callable

import torch
import torch.multiprocessing as mp

# A worker of these tests trains for seconds to about a minute on two cores; ten times that is a hang.
LIMIT_S = 600


def free_port() -> int:
    """A TCP port nothing listens on now (the rendezvous of one launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_torchrun_would(rank: int, world: int, port: int) -> None:
    """The environment ``torchrun`` gives a worker, one thread each (two workers share two cores)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _watched(rank: int, worker: Callable, limit_s: float, args: tuple) -> None:
    """``worker(rank, *args)`` under the watchdog. Once it returns, everything the test compares is
    on disk: the process leaves without running destructors. On torch 2.13 (CPU) a DDP reducer's
    gloo process group, freed at exit, once deadlocked joining a thread that waited for the GIL,
    and ``mp.spawn`` waited for ever. A worker that raised leaves through ``mp.spawn``'s own path
    (the error reaches the test), still watched."""
    faulthandler.dump_traceback_later(limit_s, exit=True)
    worker(rank, *args)
    faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(worker: Callable, args: tuple, nprocs: int = 2, limit_s: float = LIMIT_S) -> None:
    """``worker(rank, *args)`` on ``nprocs`` fresh processes; returns when all have finished, raises
    what one of them raised (``mp.ProcessRaisedException``) or how one ended (its stacks are on
    standard error when the watchdog ended it)."""
    mp.spawn(_watched, args=(worker, limit_s, args), nprocs=nprocs, join=True)


def spawn_on_a_free_port(worker: Callable, args_for: Callable[[int], tuple], nprocs: int = 2,
                         limit_s: float = LIMIT_S, tries: int = 3) -> None:
    """:func:`spawn` with ``args_for(port)``, ``port`` a :func:`free_port` for the rendezvous. A port
    found free can be taken before the workers listen on it (another job on the host opening
    connections: a GPU record's two-card tests beside its one-card suite once failed so); a launch
    that fails with ``EADDRINUSE`` is tried again on a new port, up to ``tries`` launches, as it
    fails before any worker has written anything. Any other failure is raised at once."""
    for attempt in range(1, tries + 1):
        try:
            return spawn(worker, args_for(free_port()), nprocs=nprocs, limit_s=limit_s)
        except mp.ProcessRaisedException as error:
            if "EADDRINUSE" not in str(error) or attempt == tries:
                raise
