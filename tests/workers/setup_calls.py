"""Counts the Python calls of each per-rank set-up stage at one world size, with a fake process group.

    setup_calls.py WORLD_SIZE MODEL   → JSON {stage: calls, ..., "local_numel": n}

Rank 1 of a fake group of WORLD_SIZE (no peers, collectives are no-ops) builds the model on the
meta device, plans and applies FSDP2, materialises its shards and builds the optimizer.
"""

from __future__ import annotations

import cProfile
import json
import pstats
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def calls(fn):
    profile = cProfile.Profile()
    profile.enable()
    result = fn()
    profile.disable()
    return result, pstats.Stats(profile).total_calls


def main(world: int, model_name: str) -> None:
    import open_clip  # noqa: F401  (a rank has it imported before its set-up: no call of the build stage)
    from torch.distributed.device_mesh import init_device_mesh

    from fsdpclip.model.build import build_model, find_towers, original_shapes
    from fsdpclip.model.trainable import decay_groups
    from fsdpclip.parallel.parallelize import apply_fsdp, materialize
    from fsdpclip.model.units import plan_units
    from fsdpclip.plan.resolved import unit_layout
    from fsdpclip.jobspec.job import FsdpSpec, ModelSpec, OptimizerSpec
    from fsdpclip.optim.adamw import build_optimizer, local

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=world)
    fsdp = FsdpSpec(param_dtype="fp32")
    counts = {}
    mesh, counts["mesh"] = calls(lambda: init_device_mesh("cpu", (world,)))
    model, counts["build"] = calls(lambda: build_model(ModelSpec(name=model_name), "meta"))
    layout = unit_layout(fsdp, model, find_towers(model), "cpu")
    units, counts["plan"] = calls(lambda: plan_units(model, find_towers(model), layout))
    _, counts["fully_shard"] = calls(lambda: apply_fsdp(model, units, fsdp, layout.reshard_after_forward, mesh))
    _, counts["materialize"] = calls(lambda: materialize(model, torch.device("cpu"), False, None))
    groups = decay_groups(original_shapes(model), OptimizerSpec().decay_rules, 0.2)
    _, counts["optimizer"] = calls(lambda: build_optimizer(model, groups, OptimizerSpec()))
    counts["local_numel"] = sum(local(p).numel() for p in model.parameters())
    print(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
