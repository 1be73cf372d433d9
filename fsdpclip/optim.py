"""AdamW over the weight-decay groups, the LR schedule and the fp16 loss scaler."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import nn

from fsdpclip.model import DecayGroup
from fsdpclip.spec import FsdpSpec, OptimizerSpec, ScheduleSpec


def build_optimizer(model: nn.Module, groups: list[DecayGroup], spec: OptimizerSpec) -> torch.optim.AdamW:
    """AdamW whose groups are the decay groups computed on the original names (before wrapping).

    fully_shard keeps parameter names, so the names find the sharded parameters.
    """
    params = dict(model.named_parameters())
    param_groups = [{"params": [params[n] for n in g.names], "weight_decay": g.weight_decay} for g in groups]
    return torch.optim.AdamW(param_groups, lr=spec.lr, betas=spec.betas, eps=spec.eps, foreach=True)


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
    """Clip the global gradient norm over all shards (None: only measure it); the norm before clipping."""
    grads = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm is not None else float("inf"))
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
