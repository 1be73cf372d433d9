"""Runs under torchrun (2 CPU ranks): trains the tiny model with the real Trainer and reports.

    parity OUT JOB   losses of each step (mean over ranks) and the trained full state
    export OUT JOB   + a checkpoint of the trained model and encode_image/encode_text on the sharded model
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdpclip.parallel.distributed import all_mean, init_distributed
from fsdpclip.jobspec.jobfile import load_job
from fsdpclip.train.metrics import Window
from fsdpclip.train.trainer import Trainer


def main(mode: str, out: str, job_file: str) -> None:
    job = load_job(job_file)
    env = init_distributed("cpu", timeout_s=60)
    trainer = Trainer(job, env)
    window, losses = Window(), []
    for _ in range(trainer.total_steps):
        loss, _ = trainer.train_step(window)
        losses.append(all_mean([loss.item()], env.device)[0])
    result = {"losses": losses}
    full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if mode == "export":
        trainer.checkpoints.save()
        torch.manual_seed(123)
        images = torch.randn(5, 3, 32, 32)
        with torch.no_grad():
            result["encode_image"] = trainer.model.encode_image(images).tolist()
            result["encode_text"] = trainer.model.encode_text(torch.randint(1, 1000, (3, 16))).tolist()
    trainer.close()
    if env.is_main:
        torch.save(full, out + ".pt")
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
