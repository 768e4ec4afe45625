"""CPU threads: one setting (env MHE_THREADS, mhe.runtime) applied by the ``mhe`` entry point
and handed to the worker processes of ``mhe compare``."""

import pytest
import torch

from mhe.cli import main
from mhe.errors import MheError
from mhe.runtime import configure_threads, requested_threads, worker_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def entry_point_threads(capsys) -> int:
    """Threads after the entry point ran a command that uses torch (here one that stops at once:
    ``mhe eval`` of a missing run; the threads are set before any command runs)."""
    assert main(["eval", "--run", "no-such-run"]) == 2
    capsys.readouterr()
    return torch.get_num_threads()


def test_entry_point_applies_mhe_threads(monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("MHE_THREADS", "2")
    torch.set_num_threads(1)
    assert entry_point_threads(capsys) == 2
    monkeypatch.setenv("MHE_THREADS", "1")
    assert entry_point_threads(capsys) == 1


def test_entry_point_default_is_one_thread_on_cpu(monkeypatch, capsys, restore_threads):
    monkeypatch.delenv("MHE_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.set_num_threads(2)
    assert entry_point_threads(capsys) == 1


def test_omp_num_threads_is_honoured_when_mhe_threads_is_unset(monkeypatch, restore_threads):
    monkeypatch.delenv("MHE_THREADS", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert requested_threads() == 3
    monkeypatch.setenv("MHE_THREADS", "0")  # 0: leave torch's own default untouched
    torch.set_num_threads(2)
    assert configure_threads() == 2


def test_compare_workers_share_the_cores(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    monkeypatch.setenv("MHE_THREADS", "4")
    assert worker_threads(4) == 2  # never more than the cores divided among the workers
    assert worker_threads(1) == 4
    monkeypatch.setenv("MHE_THREADS", "0")
    assert worker_threads(3) == 2


def test_bad_setting_is_one_line_exit_2(monkeypatch, capsys, restore_threads):
    monkeypatch.setenv("MHE_THREADS", "many")
    with pytest.raises(MheError, match="MHE_THREADS must be a non-negative integer, got 'many'"):
        requested_threads()
    for argv in (["params", "--preset", "bert-base", "--kinds", "mha", "--json"], ["eval", "--run", "no-such-run"]):
        assert main(argv) == 2  # a command without torch and one with it
        assert "MHE_THREADS must be a non-negative integer" in capsys.readouterr().err
