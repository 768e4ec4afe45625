"""One code path for one GPU and many: ``torchrun`` sets the environment, we read it."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def launched_rank() -> int:
    """This process's rank as ``torchrun`` set it (0 when not launched by it)."""
    return int(os.environ.get("RANK", "0"))


def setup(device: str = "auto") -> Dist:
    """Initialise the process group when launched by torchrun; pick the device."""
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
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, local, dev)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
