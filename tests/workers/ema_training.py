"""The real Trainer with an `ema` block (torchrun, 2 CPU ranks) beside timm's ModelEmaV3 on an unsharded copy of its
weights, then one evaluation of `eval.ema`. Rank 0 prints JSON: the largest difference between the Trainer's
averages and timm's (updated after each step the Trainer averages: each `every_steps`-th but the one skipped for
its non-finite gradient), that to a timm average that took the skipped step too, whether the skipped step left
the weights and the weights inside the evaluation were the averages, and whether the weights after it are the
ones before, bitwise.

    ema_training.py JOB SKIPPED_STEP
"""

from __future__ import annotations

import json
import sys

import torch
from timm.utils.model_ema import ModelEmaV3
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdpclip.model.build import model_from_config
from fsdpclip.parallel.distributed import init_distributed
from fsdpclip.jobspec.jobfile import load_job
from fsdpclip.train.metrics import MetricsLog, Window
from fsdpclip.optim.adamw import local
from fsdpclip.train.trainer import Trainer


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model state, on every rank."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def largest_difference(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    return max((ours[name] - theirs[name]).abs().max().item() for name in ours)


def main(job_file: str, skipped_step: str) -> None:
    job = load_job(job_file)
    env = init_distributed("cpu", timeout_s=60)
    trainer = Trainer(job, env)
    spec = job.moving_average
    assert trainer.ema is not None and spec is not None
    reference = model_from_config(trainer.model_config, device="cpu")
    reference.load_state_dict(gathered(trainer.model))
    timm_ema, taking_every_step = (ModelEmaV3(reference, decay=spec.decay, update_after_step=spec.start_step,
                                              use_warmup=spec.warmup) for _ in range(2))
    forward_backward, window, skip = trainer.forward_backward, Window(), int(skipped_step)

    def poisoned(batches):
        loss = forward_backward(batches)
        local(trainer.trained[0].grad).fill_(float("inf"))
        return loss

    left = None
    for step in range(1, trainer.total_steps + 1):
        trainer.forward_backward = poisoned if step == skip else forward_backward
        before = gathered(trainer.model)
        trainer.train_step(window)
        reference.load_state_dict(gathered(trainer.model))
        if step == skip:
            left = all(torch.equal(reference.state_dict()[k], before[k]) for k in before)
        if step % spec.every_steps == 0:
            taking_every_step.update(reference, step=step)
            if step != skip:
                timm_ema.update(reference, step=step)
    averages = {name: tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
                for name, tensor in trainer.ema.state_dict().items()}
    expected = {name: timm_ema.module.state_dict()[name] for name in averages}
    unskipped = {name: taking_every_step.module.state_dict()[name] for name in averages}
    weights = {name: reference.state_dict()[name] for name in averages}

    inside: dict[str, torch.Tensor] = {}
    evaluate = trainer.evaluator.evaluate

    def watched() -> dict:
        inside.update(gathered(trainer.model))
        return evaluate()

    trainer.evaluator.evaluate = watched
    before = gathered(trainer.model)
    metrics = MetricsLog(job.run_dir, trainer.total_steps, tensorboard=False, enabled=env.is_main)
    trainer.evaluator.report(metrics, trainer.progress.step)
    metrics.close()
    after = gathered(trainer.model)
    trainer.close()
    if env.is_main:
        record = json.loads((job.run_dir / "metrics.jsonl").read_text().splitlines()[-1])
        print(json.dumps({
            "names": sorted(averages), "difference": largest_difference(averages, expected),
            "apart_from_unskipped": largest_difference(averages, unskipped),
            "moved": largest_difference(expected, weights), "skipped_step_left_the_weights": left,
            "skipped_steps": int(trainer.progress.skipped_steps.item()),
            "evaluated_the_averages": all(torch.equal(inside[name], averages[name]) for name in averages),
            "evaluated_frozen_as_trained": all(torch.equal(inside[name], before[name])
                                               for name in before if name not in averages),
            "weights_after_evaluation_bitwise": all(torch.equal(after[name], before[name]) for name in before),
            "record": {key: value for key, value in record.items() if key != "time"}}))


if __name__ == "__main__":
    main(*sys.argv[1:])
