"""Runs under torchrun (CPU ranks): trains each case of a parity matrix with the real Trainer, one
after the other in one process group, and saves what the test compares with the reference.

    parity.py CASES.json OUT_DIR

CASES.json maps a case name to {"job": <spec>, "poison": [step, rank] or null, "compile_backend":
torch.compile's backend for fsdp.compile, or null for its default}. For each case rank 0
writes OUT_DIR/<name>.pt: {"losses", "norms" (per step, losses averaged over ranks), "initial" and
"state" (the full model before the first and after the last step), "scale" (fp16 loss scale),
"temperature_fp32" (a forward returns exp(logit_scale) computed in fp32 from the parameter), "groups"
(the optimizer's decay groups by original name), "encode_image"/"encode_text" (on fixed inputs) and, with
a poisoned step, "poisoned_step_unchanged" (no weight, moment or step count changed on any rank) and
the loss scale before and after it}.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdpclip.parallel.distributed import all_mean, init_distributed
from fsdpclip.parallel.parallelize import reshard
from fsdpclip.jobspec.jobfile import parse_job
from fsdpclip.train.metrics import Window
from fsdpclip.optim.adamw import local
from fsdpclip.train.trainer import Trainer

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Poisoned(torch.nn.Module):
    """The trainer's loss, infinite on one rank at one step (what an fp16 overflow looks like)."""

    def __init__(self, loss_fn, trainer: Trainer, step: int, rank: int):
        super().__init__()
        self.loss_fn, self.trainer, self.step, self.rank = loss_fn, trainer, step, rank

    def forward(self, *outputs):
        loss = self.loss_fn(*outputs)
        hit = self.trainer.progress.step + 1 == self.step and self.trainer.env.rank == self.rank
        return loss * float("inf") if hit else loss


def local_state(trainer: Trainer) -> list[torch.Tensor]:
    """Copies of this rank's weights and optimizer state (moments and step counts)."""
    tensors = [local(p) for p in trainer.model.parameters()]
    for state in trainer.optimizer.state.values():
        tensors += [local(state[key]) for key in ("exp_avg", "exp_avg_sq", "step")]
    return [t.detach().clone() for t in tensors]


def temperature_is_fp32(trainer: Trainer) -> bool:
    """Whether a forward returns exp(logit_scale) as fp32 arithmetic on the parameter gives it."""
    torch.manual_seed(0)
    with torch.no_grad():
        outputs = trainer.model(torch.randn(2, 3, 32, 32), torch.randint(1, 1000, (2, 16)))
        expected = trainer.model.logit_scale.float().exp()
    reshard(trainer.model)
    return outputs[2].dtype == torch.float32 and torch.equal(outputs[2], expected)


def decay_groups(trainer: Trainer) -> list[dict]:
    """The optimizer's groups: weight decay, LR scale and the original names of their parameters."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return [{"weight_decay": g["weight_decay"], "lr_scale": g["lr_scale"], "names": sorted(names[id(p)] for p in g["params"])}
            for g in trainer.optimizer.param_groups]


def encodings(trainer: Trainer) -> dict:
    """encode_image / encode_text called on the sharded model outside forward, on fixed inputs."""
    torch.manual_seed(123)
    with torch.no_grad():
        out = {"encode_image": trainer.model.encode_image(torch.randn(5, 3, 32, 32)),
               "encode_text": trainer.model.encode_text(torch.randint(1, 1000, (3, 16)))}
    reshard(trainer.model)
    return out


def run_case(name: str, case: dict, env, out: Path) -> None:
    compile_ = torch.compile
    if case.get("compile_backend"):  # fsdp.compile through another backend than inductor
        torch.compile = functools.partial(compile_, backend=case["compile_backend"])
    try:
        trainer = Trainer(parse_job(case["job"]), env)
    finally:
        torch.compile = compile_
    poison = case.get("poison")
    if poison:
        trainer.loss_fn = Poisoned(trainer.loss_fn, trainer, *poison)
    initial = {k: v.clone() for k, v in get_model_state_dict(trainer.model, options=FULL).items()}
    window, result = Window(), {"losses": [], "norms": []}
    for _ in range(trainer.total_steps):
        poisoned = poison is not None and trainer.progress.step + 1 == poison[0]
        if poisoned:
            before, result["scale_before_poison"] = local_state(trainer), trainer.scaler.get_scale()
        loss, norm = trainer.train_step(window)
        result["losses"].append(all_mean([loss.item()], env.device)[0])
        result["norms"].append(norm.item())
        if poisoned:
            same = all(torch.equal(a, b) for a, b in zip(before, local_state(trainer)))
            result["poisoned_step_unchanged"] = all_mean([float(same)], env.device)[0] == 1.0
            result["scale_after_poison"] = trainer.scaler.get_scale()
    result["temperature_fp32"] = temperature_is_fp32(trainer)
    result.update(groups=decay_groups(trainer), **encodings(trainer))
    result.update(initial=initial, state=get_model_state_dict(trainer.model, options=FULL),
                  scale=trainer.scaler.get_scale() if trainer.scaler is not None else None)
    trainer.close()
    if env.is_main:
        torch.save(result, out / f"{name}.pt")


def main(cases_file: str, out_dir: str) -> None:
    cases = json.loads(Path(cases_file).read_text())
    env = init_distributed("cpu", timeout_s=120)
    for name, case in cases.items():
        run_case(name, case, env, Path(out_dir))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
