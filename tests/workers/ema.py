"""A sharded EMA (`fsdpclip.optim.ema.ShardedEma`) beside timm's ModelEmaV3 on the same weights (torchrun, every
rank): a small FSDP2 model with a frozen layer and a batch norm trains STEPS steps; after each, timm's EMA averages
an unsharded copy holding the gathered weights. Rank 0 prints JSON: the largest difference between the two
averages, and whether swapping the average in and out leaves what it should.

    ema.py DECAY EVERY_STEPS START_STEP WARMUP(0|1) STEPS
"""

from __future__ import annotations

import copy
import json
import sys

import torch
from timm.utils.model_ema import ModelEmaV3
from torch.distributed.fsdp import fully_shard

from fsdpclip.parallel.distributed import init_distributed
from fsdpclip.optim.ema import ShardedEma


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in model.state_dict().items()}


def main(decay: str, every: str, start: str, warmup: str, steps: str) -> None:
    env = init_distributed("cpu", timeout_s=60)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 7))  # 32 rows over 2 ranks, 7 unevenly
    model[0].requires_grad_(False)
    reference = copy.deepcopy(model)
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=env.mesh)
    fully_shard(model, mesh=env.mesh)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ema = ShardedEma(model, float(decay), int(every), int(start), warmup == "1")
    timm_ema = ModelEmaV3(reference, decay=float(decay), update_after_step=int(start), use_warmup=warmup == "1")
    torch.manual_seed(1)
    for step in range(1, int(steps) + 1):
        model(torch.randn(12, 16)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(step)
        reference.load_state_dict(gathered(model))
        if step % int(every) == 0:
            timm_ema.update(reference, step=step)
    expected = timm_ema.module.state_dict()
    averages = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t) for name, t in ema.state_dict().items()}
    difference = max((averages[name] - expected[name]).abs().max().item() for name in averages)
    moved = max((expected[name] - reference.state_dict()[name]).abs().max().item() for name in averages)
    before = gathered(model)
    with ema.swapped_in():
        inside = gathered(model)
    after = gathered(model)
    if env.rank == 0:
        print(json.dumps({
            "names": sorted(averages), "difference": difference, "moved": moved,
            "swapped_in": all(torch.equal(inside[name], averages[name]) for name in averages),
            "put_back": all(torch.equal(after[name], before[name]) for name in before),
            "frozen_untouched": torch.equal(inside["0.weight"], before["0.weight"])}))


if __name__ == "__main__":
    main(*sys.argv[1:])
