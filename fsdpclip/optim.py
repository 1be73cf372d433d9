"""AdamW over the weight-decay groups, the LR schedule and the fp16 loss scaler."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdpclip.trainable import DecayGroup
from fsdpclip.spec import FsdpSpec, OptimizerSpec, ScheduleSpec


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (a view, no copy); a plain tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class ShardedAdamW(torch.optim.AdamW):
    """AdamW that steps each rank's local shards with the fused kernel.

    Its state is AdamW's own (DTensors), so checkpoints and resharding are unchanged; the step
    skips DTensor dispatch (one fused kernel per group) and, given `found_inf`, skips itself on
    the device when the gradients are not finite, without a host sync.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, fused=True, **kwargs)  # fused: `step` state lives on the device

    @torch.no_grad()
    def step(self, closure=None, found_inf: Optional[torch.Tensor] = None):
        if closure is not None:
            raise ValueError("ShardedAdamW does not take a closure")
        for group in self.param_groups:
            params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32, device=local(param).device)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                params.append(local(param))
                grads.append(local(param.grad))
                exp_avgs.append(local(state["exp_avg"]))
                exp_avg_sqs.append(local(state["exp_avg_sq"]))
                steps.append(state["step"])
            if not params:
                continue
            torch._foreach_add_(steps, 1)
            beta1, beta2 = group["betas"]
            torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], steps, amsgrad=False, lr=group["lr"],
                                beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                                maximize=False, grad_scale=None, found_inf=found_inf)
            if found_inf is not None:
                torch._foreach_sub_(steps, [found_inf] * len(steps))


def build_optimizer(model: nn.Module, groups: list[DecayGroup], spec: OptimizerSpec) -> ShardedAdamW:
    """AdamW whose groups are the decay groups computed on the original names (before wrapping).

    fully_shard keeps parameter names, so the names find the sharded parameters.
    """
    params = dict(model.named_parameters())
    param_groups = [{"params": [params[n] for n in g.names], "weight_decay": g.weight_decay} for g in groups]
    return ShardedAdamW(param_groups, lr=spec.lr, betas=spec.betas, eps=spec.eps)


def lr_factor(schedule: ScheduleSpec, peak_lr: float, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the peak LR at each step: linear warmup, then cosine to `min_lr` or constant."""
    warmup, floor = schedule.warmup_steps, schedule.min_lr / peak_lr

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if schedule.kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: ScheduleSpec, peak_lr: float,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, peak_lr, total_steps))


def build_grad_scaler(fsdp: FsdpSpec, device: torch.device):
    """A dynamic loss scaler that agrees across ranks on sharded (and CPU-offloaded) gradients, or None."""
    enabled = fsdp.param_dtype == "fp16" if fsdp.grad_scaler.enabled == "auto" else fsdp.grad_scaler.enabled
    if not enabled:
        return None
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device=device.type, init_scale=fsdp.grad_scaler.init_scale,
                             growth_interval=fsdp.grad_scaler.growth_interval)


def clip_gradients(model: nn.Module, max_norm: Optional[float]) -> torch.Tensor:
    """The global gradient norm (over all shards), clipping to `max_norm` when set; no host sync.

    Works on each rank's local shards: one foreach norm, one all-reduce of a scalar.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    shards = [local(g) for g in grads]
    squares = torch.stack(torch._foreach_norm(shards)).float().square().sum() if shards else \
        torch.zeros((), device=next(model.parameters()).device)
    if any(isinstance(g, DTensor) for g in grads):
        dist.all_reduce(squares)
    norm = squares.sqrt()
    if max_norm is not None and shards:
        torch._foreach_mul_(shards, (max_norm / (norm + 1e-6)).clamp(max=1.0).to(shards[0].dtype))
    return norm
