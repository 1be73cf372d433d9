"""The process group, device and device mesh of one rank."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Dist:
    """Where this process stands: its rank, the world, its device and the 1-D mesh FSDP shards over."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_kind: str, timeout_s: float, cpu_collectives: bool = False) -> Dist:
    """Join the process group torchrun describes (or a group of one without torchrun).

    `cpu_collectives` adds gloo next to NCCL for tensors that live on the CPU (offloaded state).
    """
    if "RANK" not in os.environ:  # a plain `python` process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_kind == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("launch.device is 'cuda' but no GPU is visible; use 'cpu' for CPU runs")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "cpu:gloo,cuda:nccl" if cpu_collectives else "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s),
                                **({"device_id": device} if device.type == "cuda" else {}))
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("fsdp",))
    return Dist(rank, world, local_rank, device, mesh)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_mean(values: list[float], device: torch.device) -> list[float]:
    """Mean of each value over all ranks (one collective)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def all_max(value: int, device: torch.device) -> int:
    """The largest of one integer over all ranks (one collective)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor.item())


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum of each value over all ranks (one collective)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()

