"""The process group, device and device meshes of one rank."""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Dist:
    """Where this process stands: its rank, the world, its device and the 1-D mesh of the whole world
    (full sharding; `shard_mesh` gives the HSDP one)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this node
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
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
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
                                device_id=device if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    return Dist(rank, world, local_rank, local_world, device, mesh)


def shard_mesh(env: Dist, shard_degree: int) -> DeviceMesh:
    """The mesh FSDP shards over for groups of `shard_degree` consecutive ranks: the world's 1-D mesh
    when one group holds every rank, else a 2-D (replicate, shard) mesh, whose last dimension is the
    shard group (HSDP: fully_shard shards over it and all-reduces across the first)."""
    if shard_degree == env.world_size:
        return env.mesh
    return init_device_mesh(env.device.type, (env.world_size // shard_degree, shard_degree),
                            mesh_dim_names=("replicate", "shard"))


def shard_group(mesh: DeviceMesh):
    """The process group of this rank's shard group (the last dimension of an FSDP mesh)."""
    return mesh.get_group(mesh.ndim - 1)


def shard_coordinate(mesh: DeviceMesh) -> tuple[int, int]:
    """(this rank's index in its shard group, the group's size)."""
    return mesh.get_local_rank(mesh.ndim - 1), mesh.size(mesh.ndim - 1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def all_mean(values: list[float], device: torch.device) -> list[float]:
    """Mean of each value over all ranks (one collective)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return (tensor / dist.get_world_size()).tolist()


def all_max(values: list[int], device: torch.device) -> list[int]:
    """The largest of each integer over all ranks (one collective)."""
    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum of each value over all ranks (one collective)."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return tensor.tolist()


# How a collective fails when a peer is gone (its process killed, its node lost): gloo's socket errors, NCCL's
# aborted communicator or its watchdog's word for an exited peer, the store's closed connection.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited",
             "communicator was aborted", "Socket closed")


def lost_peer(error: BaseException) -> Optional[str]:
    """How this rank's collective failed (one of PEER_LOST) where it failed because another rank is gone, else
    None: a consequence, which the launcher names from that rank's own report, not a fault of this one."""
    if isinstance(error, RuntimeError):  # torch's collective errors (DistBackendError and gloo's are RuntimeErrors)
        return next((words for words in PEER_LOST if words in str(error)), None)
    return None
