"""Checkpoints of a sharded model whose disk another writer fills after the space check and before the write
(a process group of one), each written by 4 threads. Prints JSON: the error each save ended with (a synchronous one,
then an asynchronous one, reported when its write is waited for), whether waiting again reports it again, and the
latest checkpoint.

    disk_fills.py RUN_DIR        (RUN_DIR on a small disk of its own)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

from fsdpclip.checkpoint import sharded as checkpoint, staging
from fsdpclip.checkpoint.layout import latest_checkpoint
from fsdpclip.parallel.distributed import init_distributed
from fsdpclip.run.files import disk_free
from fsdpclip.jobspec.job import CheckpointSpec

FILLER_KEEPS_FREE = 2 ** 18  # bytes the filler leaves: room for the rank state, not for the shards


def sharded_model(env) -> torch.nn.Module:
    """Large enough (~6 MB of weights and AdamW state) that its shards need far more than the filler leaves."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    for layer in model:
        fully_shard(layer, mesh=env.mesh)
    return fully_shard(model, mesh=env.mesh)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 512)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def fill_after_the_check(saver: checkpoint.Checkpointer, filler: Path) -> None:
    """Make `saver`'s space check be followed by a file that leaves FILLER_KEEPS_FREE bytes on the disk."""
    check = saver._check_space

    def check_then_fill(final, state):
        needed = check(final, state)
        with open(filler, "wb") as file:
            file.truncate(0)
            room = disk_free(filler.parent) - FILLER_KEEPS_FREE
            file.write(b"\0" * max(0, room))
        return needed

    saver._check_space = check_then_fill


def ended_with(call) -> str:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001  (what reaches the trainer, CheckpointException included)
        return f"{type(exc).__name__}: {exc}"
    return "ok"


def main(run_dir: str) -> None:
    staging.write_threads = lambda: 4  # DCP's threads beside the caller's, whatever the cores
    env = init_distributed("cpu", timeout_s=60)
    model = sharded_model(env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    saver = checkpoint.Checkpointer(Path(run_dir), CheckpointSpec(keep=3), env.rank, env.world_size)
    step(model, optimizer)
    saver.save(1, model, optimizer, {"samples_seen": 0}, {})
    filler = Path(run_dir).parent / "filler"
    fill_after_the_check(saver, filler)
    step(model, optimizer)
    ended = {"synchronous": ended_with(lambda: saver.save(2, model, optimizer, {"samples_seen": 0}, {}))}
    filler.unlink()
    step(model, optimizer)
    saver.save(3, model, optimizer, {"samples_seen": 0}, {}, asynchronous=True)
    ended["asynchronous"] = ended_with(lambda: saver.finish_pending(wait=True))
    ended["waited_again"] = ended_with(lambda: saver.finish_pending(wait=True))
    latest = latest_checkpoint(Path(run_dir))
    print(json.dumps({**ended, "latest": latest.name if latest else None}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
