"""Two asynchronous saves of a sharded model, AdamW and a moving average of the weights (torchrun, every rank); each
followed at once by an optimizer step and an update of the average that change every parameter and average in
place while the write goes on. Rank 0 prints JSON: where the saves were staged and whether each checkpoint holds
the values and the average of its own step.

    async_save.py RUN_DIR DEVICE [HEADROOM]     (HEADROOM: the share of device memory kept free)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import fully_shard

from fsdpclip.checkpoint import sharded as checkpoint, staging
from fsdpclip.checkpoint.layout import checkpoint_name
from fsdpclip.parallel.distributed import init_distributed
from fsdpclip.jobspec.job import CheckpointSpec
from fsdpclip.optim.ema import ShardedEma


def sharded_model(env) -> torch.nn.Module:
    """On the run's mesh (left to itself, fully_shard takes a CUDA mesh wherever CUDA is visible)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).to(env.device)
    for layer in model:
        fully_shard(layer, mesh=env.mesh)
    return fully_shard(model, mesh=env.mesh)


def full_values(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu().clone() for k, v in state.items()}


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 64, device=next(model.parameters()).device)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def main(run_dir: str, device_kind: str, headroom: str = "") -> None:
    if headroom:
        staging.DEVICE_HEADROOM = float(headroom)
    env = init_distributed(device_kind, timeout_s=60, cpu_collectives=device_kind == "cuda")
    model = sharded_model(env)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    ema = ShardedEma(model, decay=0.5)
    saver = checkpoint.Checkpointer(Path(run_dir), CheckpointSpec(keep=3), env.rank, env.world_size)
    saver.host.reserve(staging.host_copy_bytes(model, list(model.parameters()), ema.state_dict()))
    saved = {}
    for number in (1, 2):
        step(model, optimizer)
        ema.update(number)
        saved[number] = full_values(get_model_state_dict(model)), full_values(ema.state_dict())
        saver.save(number, model, optimizer, {"samples_seen": 0}, {}, asynchronous=True, averages=ema.state_dict())
        step(model, optimizer)  # in place, while the write goes on
        ema.update(number + 10)
    saver.finish_pending(wait=True)
    held = {}
    for number in (1, 2):
        fresh = sharded_model(env)
        fresh_ema = ShardedEma(fresh, decay=0.5)
        *_, averaged = saver.load(saver.root / checkpoint_name(number), fresh, torch.optim.AdamW(fresh.parameters()),
                                  fresh_ema.state_dict())
        weights, averages = saved[number]
        held[number] = averaged and \
            all(torch.equal(full_values(get_model_state_dict(fresh))[k], v) for k, v in weights.items()) and \
            all(torch.equal(full_values(fresh_ema.state_dict())[k], v) for k, v in averages.items())
    if env.is_main:
        print(json.dumps({"staging": saver.staging, "holds_its_step": held,
                          "carved": saver.host.buffer is not None and saver.host.state is not None}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
