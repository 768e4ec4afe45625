"""The two-process tests' launcher (tests/processes.py): a worker that finishes leaves at once with
status 0; one that hangs is ended by its watchdog, with its stack on standard error, and the
launch fails instead of waiting for ever."""

import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from processes import spawn


def _writes(rank: int, out: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(str(rank))


def _hangs_in_a_named_place(rank: int) -> None:
    time.sleep(120)


def test_finished_workers_return_and_their_files_stay(tmp_path):
    spawn(_writes, (str(tmp_path),), nprocs=2, limit_s=120)
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0", "1"]


def test_a_hung_worker_is_ended_with_its_stack(capfd):
    started = time.monotonic()
    with pytest.raises(mp.ProcessExitedException, match="exit code 1"):
        spawn(_hangs_in_a_named_place, (), nprocs=1, limit_s=3)
    assert time.monotonic() - started < 60  # not the 120 s the worker sleeps
    assert "_hangs_in_a_named_place" in capfd.readouterr().err  # where it hung
