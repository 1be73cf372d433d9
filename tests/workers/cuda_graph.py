"""Runs under torchrun on CUDA GPUs: trains the tiny model with the real Trainer, eager and with the step
CUDA-graphed (fsdp.cuda_graph), from the same weights on the same synthetic batches, and prints the
losses of both and the largest relative difference of the trained parameters, as one JSON line.

    torchrun --nproc-per-node=N tests/workers/cuda_graph.py RUN_ROOT GRAD_ACCUM
"""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdpclip.parallel.distributed import all_mean, init_distributed
from fsdpclip.jobspec.jobfile import parse_job
from fsdpclip.train.metrics import Window
from fsdpclip.train.trainer import Trainer

STEPS = 8
TINY = "examples/models/tiny-clip.json"


def train(run_root: str, name: str, cuda_graph: bool, accum: int, env) -> tuple[list[float], dict, int]:
    job = parse_job({"run": {"name": name, "output_dir": run_root}, "model": {"config": TINY},
                     "fsdp": {"param_dtype": "fp32", "cuda_graph": cuda_graph},
                     "optimizer": {"lr": 1e-3}, "schedule": {"kind": "constant", "steps": STEPS},
                     "data": {"source": "synthetic"}, "batch": {"per_gpu": 16, "grad_accum": accum},
                     "checkpoint": {"resume": None, "at_end": False},
                     "launch": {"gpus_per_node": env.world_size, "device": "cuda"}})
    trainer = Trainer(job, env)
    window, losses = Window(), []
    for _ in range(STEPS):
        loss, _ = trainer.train_step(window)
        losses.append(all_mean([loss.item()], env.device)[0])
        trainer.optimizer.zero_grad(set_to_none=True)  # what user code may do: the graphed step puts them back
    state = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    replays = getattr(trainer.forward_backward, "replays", 0)
    trainer.close()
    return losses, state, replays


def main(run_root: str, accum: int) -> None:
    env = init_distributed("cuda", timeout_s=120)
    eager, eager_state, _ = train(run_root, "eager", False, accum, env)
    graphed, graphed_state, replays = train(run_root, "graphed", True, accum, env)
    difference = max(((graphed_state[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12)).item()
                     for k, v in eager_state.items())
    dist.destroy_process_group()  # with NCCL this waits for every graph holding its collectives: close() dropped ours
    if env.is_main:
        print(json.dumps({"eager": eager, "graphed": graphed, "replays": replays, "parameter_difference": difference}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
