"""The two-process tests' launcher (tests/processes.py): a worker that finishes leaves at once with
status 0; one that hangs is ended by its watchdog, with its stack on standard error, and the
launch fails instead of waiting for ever."""

import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from processes import spawn, spawn_on_a_free_port


def _writes(rank: int, out: str) -> None:
    Path(out, f"rank{rank}.txt").write_text(str(rank))


def _port_taken_once(rank: int, port: int, out: str) -> None:
    """Fails as a taken rendezvous port does on its first launch; records each launch's port."""
    seen = Path(out, f"rank{rank}-ports.txt")
    ports = seen.read_text().split() if seen.exists() else []
    seen.write_text(" ".join(ports + [str(port)]))
    if not ports:
        raise RuntimeError(f"port: {port}, code: -98, name: EADDRINUSE, message: address already in use")


def _fails_otherwise(rank: int, port: int, out: str) -> None:
    with open(Path(out, "launches.txt"), "a") as f:
        f.write(f"{port}\n")
    raise RuntimeError("another failure")


def _port_always_taken(rank: int, port: int, out: str) -> None:
    with open(Path(out, "launches.txt"), "a") as f:
        f.write(f"{port}\n")
    raise RuntimeError(f"port: {port}, code: -98, name: EADDRINUSE, message: address already in use")


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


def test_a_launch_whose_port_was_taken_is_tried_again_on_another(tmp_path):
    spawn_on_a_free_port(_port_taken_once, lambda port: (port, str(tmp_path)), nprocs=1, limit_s=120)
    ports = (tmp_path / "rank0-ports.txt").read_text().split()
    assert len(ports) == 2 and ports[0] != ports[1]  # failed once, then ran on a new port


def test_other_failures_are_raised_after_one_launch(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="another failure"):
        spawn_on_a_free_port(_fails_otherwise, lambda port: (port, str(tmp_path)), nprocs=1, limit_s=120)
    assert len((tmp_path / "launches.txt").read_text().split()) == 1


def test_a_port_taken_at_every_launch_fails_after_the_tries(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="EADDRINUSE"):
        spawn_on_a_free_port(_port_always_taken, lambda port: (port, str(tmp_path)), nprocs=1, limit_s=120, tries=3)
    assert len((tmp_path / "launches.txt").read_text().split()) == 3
