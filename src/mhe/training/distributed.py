"""One code path for one GPU and many: ``torchrun`` sets the environment, we read it."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mhe.runtime import check_launch_env, launched_rank  # noqa: F401 (launched_rank re-exported)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    host_group: object = None  # a gloo group for host-side agreement (None: the default group)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def agreed_signal(self, signum: int | None) -> int | None:
        """The signal any process has received (the largest number; None: none has), so that
        all of them stop after the same step and save together: a signal reaches the
        processes of a ``torchrun`` at slightly different moments, and a process that stopped
        alone would leave the others waiting in a collective. A host-side all-reduce (gloo):
        no wait for the device."""
        if self.world == 1:
            return signum
        flag = torch.tensor([signum or 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.host_group)
        return int(flag.item()) or None


def setup(device: str = "auto") -> Dist:
    """Initialise the process group when launched by torchrun (its environment whole, else one
    line: :func:`mhe.runtime.check_launch_env`); pick the device."""
    check_launch_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = launched_rank()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device(device)
    host = None
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        if dist.get_backend() != "gloo":
            host = dist.new_group(backend="gloo")
    return Dist(rank, world, local, dev, host)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def peak_memory(device: torch.device) -> float | None:
    """GiB the allocator has held at most on a CUDA device (a host-side counter: no sync)."""
    return torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None


def device_name(device: torch.device) -> str:
    """The card a run trained on, for the record (results must name it)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"
