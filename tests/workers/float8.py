"""fsdp.float8 on the CPU, torchao emulating its GEMMs; a small CLIP whose image MLPs are large enough for float8.

    torchrun --nproc-per-node=2 tests/workers/float8.py train RUN_ROOT MODEL_CONFIG
        2 CPU ranks (gloo), the real Trainer, bf16 and then float8 from the same weights on the same synthetic
        batches; the float8 run's checkpoint (saved asynchronously) resumed in float8, then (saved again) without
    python tests/workers/float8.py parallelize MODEL_CONFIG
        `parallelize` on the meta device over a fake process group of 2, compiled, with each recipe: the layers
        swapped, those whose weights are gathered in float8, the inductor options of each torch.compile call
    python tests/workers/float8.py ema
        rank 2 of a fake process group of 3: a sharded EMA of two linear layers gathered in float8, one sharded
        unevenly (40 rows over 3 ranks), whose shards FSDP gives new storage when a state dict is loaded

Each prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch
import torch.distributed as dist

from fsdpclip.parallel.distributed import all_mean, init_distributed
from fsdpclip.jobspec.jobfile import parse_job
from fsdpclip.train import building
from fsdpclip.train.metrics import Window
from fsdpclip.train.trainer import Trainer

STEPS = 4
GATHERED_IN_FLOAT8 = "WeightWithDynamicFloat8CastTensor"  # torchao's class of a local shard FSDP gathers in float8


def job(run_root: str, config: str, name: str, float8: bool, steps: int = STEPS, resume=None):
    return parse_job({"run": {"name": name, "output_dir": run_root}, "model": {"config": config},
                      "fsdp": {"float8": float8}, "optimizer": {"lr": 1e-3},
                      "schedule": {"kind": "constant", "steps": steps}, "data": {"source": "synthetic"},
                      "batch": {"per_gpu": 4}, "checkpoint": {"resume": resume},
                      "launch": {"gpus_per_node": 2, "device": "cpu"}})


def train(trainer: Trainer, env) -> list[float]:
    window, losses = Window(), []
    while trainer.progress.step < trainer.total_steps:
        loss, _ = trainer.train_step(window)
        losses.append(all_mean([loss.item()], env.device)[0])
    return losses


def float8_weights(model) -> dict:
    """The float8 layers by name: the class of each one's local shard and whether its scale is precomputed."""
    return {name: {"local": type(module.weight._local_tensor).__name__,
                   "precomputed": getattr(module.weight._local_tensor, "_precomputed_scale", None) is not None}
            for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}


def trained(run_root: str, config: str) -> None:
    env = init_distributed("cpu", timeout_s=120)
    building.float8_problem = lambda device: None  # the CPU stands in for a GPU with float8 GEMMs
    result = {}
    for float8 in (False, True):
        trainer = Trainer(job(run_root, config, f"float8-{float8}", float8), env)
        result[f"losses_{float8}"] = train(trainer, env)
        if float8:
            result["layers"], result["precomputing"] = float8_weights(trainer.model), trainer.built.float8_scales
            trainer.checkpoints.save(asynchronous=True)  # its host copy written on a thread
            trainer.checkpoints.finish_saving(wait=True)
        trainer.close()
    for steps, float8 in ((STEPS + 2, True), (STEPS + 4, False)):  # its checkpoint resumed, then the next without
        trainer = Trainer(job(run_root, config, "float8-True", float8, steps=steps, resume="latest"), env)
        result[f"resumed_{float8}"] = {"at": trainer.progress.step, "losses": train(trainer, env),
                                       "layers": len(float8_weights(trainer.model))}
        trainer.checkpoints.save()
        trainer.close()
    dist.destroy_process_group()
    if env.is_main:
        print(json.dumps(result))


def parallelized(config: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdpclip.model.build import build_model, find_towers
    from fsdpclip.parallel.parallelize import parallelize
    from fsdpclip.plan.resolved import unit_layout
    from fsdpclip.jobspec.job import FsdpSpec, ModelSpec

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    compiled, original = [], torch.compile

    def recording_compile(fn, **kwargs):
        compiled.append(kwargs.get("options"))
        return original(fn, **kwargs)

    torch.compile = recording_compile
    result = {}
    for recipe in ("tensorwise", "rowwise"):
        model, compiled[:] = build_model(ModelSpec(config=config), "meta"), []
        fsdp = FsdpSpec(float8=True, float8_recipe=recipe, compile=True, compile_options={"max_autotune": False})
        layout = dataclasses.replace(unit_layout(fsdp, model, find_towers(model), "cuda"), float8=True)
        parallelize(model, fsdp, layout, init_device_mesh("cpu", (2,)))
        result[recipe] = {"float8": {name: str(module.config.cast_config_weight.scaling_granularity.value)
                                     for name, module in model.named_modules()
                                     if type(module).__name__ == "Float8Linear"},
                          "gathered": sorted(name for name, p in model.named_parameters()
                                             if type(getattr(p, "_local_tensor", p)).__name__ == GATHERED_IN_FLOAT8),
                          "compiled": compiled[:]}
    dist.destroy_process_group()
    print(json.dumps(result))


def averaged() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdpclip.model.float8 import convert_to_float8
    from fsdpclip.optim.ema import ShardedEma

    dist.init_process_group("fake", store=FakeStore(), rank=2, world_size=3)
    mesh = init_device_mesh("cpu", (3,))
    model = torch.nn.Sequential(torch.nn.Linear(32, 40), torch.nn.Linear(40, 48))
    convert_to_float8(model, ["0", "1"], "tensorwise", gather_in_float8=True, emulate=True)
    for module in (model[0], model[1], model):
        fully_shard(module, mesh=mesh)
    ema = ShardedEma(model, 0.5)

    def shards() -> dict:
        """Each weight's local shard as FSDP holds it now, unwrapped."""
        return {f"{i}.weight": model[i].weight._local_tensor._tensor for i in (0, 1)}

    storage = {name: shard.data_ptr() for name, shard in shards().items()}
    model.load_state_dict(model.state_dict())  # as a resume's set_state_dict does
    moved = [name for name, shard in shards().items() if shard.data_ptr() != storage[name]]
    tracks = []
    for step in (1, 2):  # a copy, then halfway between the average and the weights
        with torch.no_grad():
            for shard in shards().values():
                shard.add_(1.0)
        ema.update(step)
        tracks.append(all(torch.equal(ema.averages[name]._local_tensor, shard) for name, shard in shards().items()))
    with ema.swapped_in():
        swapped = all(torch.equal(shard, ema.averages[name]._local_tensor) for name, shard in shards().items())
    dist.destroy_process_group()
    print(json.dumps({"storage_moved": moved, "equal_to_weights": tracks, "swapped_in": swapped,
                      "uneven": list(model[0].weight._local_tensor.shape)}))


if __name__ == "__main__":
    {"train": trained, "parallelize": parallelized, "ema": averaged}[sys.argv[1]](*sys.argv[2:])
