"""An exponential moving average of the trained weights, kept sharded as the weights are (`ShardedEma`).

timm's `ModelEmaV3` (what open_clip main uses, and refuses under FSDP2) keeps a deep copy of the whole model.
Here each rank averages only its own shards: the average of a parameter is a float32 DTensor of the
parameter's mesh and placements, so no rank holds a full copy, a checkpoint saves and reshards it as it does
the weights, and its update is a lerp of the rank's local tensors. Frozen parameters are left out (their average
is themselves); floating-point buffers of the state dict (a ResNet tower's batch-norm statistics) are averaged too,
as timm does. A step the optimizer skipped (a non-finite gradient, an fp16 overflow) is skipped by the average as
well, where timm's training loop averages the unchanged weights in once more; the decay counts optimizer steps,
those skipped too, as timm's loop counts its updates.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from torch import nn

from fsdpclip.model.float8 import forget_float8_scales, without_float8_wrapper
from fsdpclip.parallel.parallelize import reshard
from fsdpclip.jobspec.job import EmaSpec
from fsdpclip.optim.adamw import local


def ema_decay(step: int, decay: float, start_step: int = 0, warmup: bool = False, every_steps: int = 1) -> float:
    """The decay of the update after optimizer step `step` (counted from 1): timm's `ModelEmaV3.get_decay`
    (0, a plain copy, up to `start_step` + 1; with `warmup`, its 1 - (1 + n)^(-2/3) ramp, capped at `decay`). Where
    updates come every few steps, the first of them copies too: no update falls on step `start_step` + 1 then, and
    the average would start from the weights as they were before training."""
    n = step - start_step - 1
    if n <= 0 or step <= start_step + every_steps:
        return 0.0
    return min(1 - (1 + n) ** (-2 / 3), decay) if warmup else decay


def averaged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an average covers, by state-dict name: the trained parameters and the floating-point buffers of the
    state dict (timm averages its floating-point entries; a frozen parameter's average is itself, and a buffer kept
    out of the state dict, such as OpenCLIP's causal mask, holds no weights)."""
    tensors: dict[str, torch.Tensor] = {name: p for name, p in model.named_parameters() if p.requires_grad}
    for prefix, module in model.named_modules():
        for key, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point() and key not in module._non_persistent_buffers_set:
                tensors[f"{prefix}.{key}" if prefix else key] = buffer
    return tensors


class ShardedEma:
    """The moving average of `model`'s trained tensors after each `every_steps`-th optimizer step (see
    `ema_decay`); `state_dict()` is its part of a checkpoint."""

    def __init__(self, model: nn.Module, decay: float, every_steps: int = 1, start_step: int = 0,
                 warmup: bool = False):
        self.model, self.decay, self.every_steps, self.start_step, self.warmup = \
            model, decay, every_steps, start_step, warmup
        self.sources = averaged_tensors(model)
        with torch.no_grad():
            self.averages = {name: without_float8_wrapper(t).detach().to(torch.float32, copy=True)
                             for name, t in self.sources.items()}

    @torch.no_grad()
    def update(self, step: int, skipped: Optional[torch.Tensor] = None) -> None:
        """Average in the weights as they are after optimizer step `step` (from 1), if that step is one to. Where
        `skipped` (the step's `found_inf`, on the device) is non-zero, the optimizer left the weights as they were
        and the average stays as it was too, decided on the device without waiting for it: each tensor is then
        its own kernel, where the fused one takes a number."""
        if step % self.every_steps:
            return
        weight = 1.0 - ema_decay(step, self.decay, self.start_step, self.warmup, self.every_steps)
        by_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for name, average in self.averages.items():  # CPU offload: the shards on the host, the rest on the device
            shard = local(average)
            averages, sources = by_device.setdefault(shard.device, ([], []))
            averages.append(shard)
            sources.append(plain_shard(self.sources[name]).to(torch.float32))
        for device, (averages, sources) in by_device.items():
            if skipped is None:
                torch._foreach_lerp_(averages, sources, weight)  # pyright: ignore[reportPrivateImportUsage]  (torch's private kernels)
            else:
                taken = (skipped.to(device).reshape(()) <= 0) * weight
                torch._foreach_lerp_(averages, sources, [taken] * len(averages))  # pyright: ignore[reportPrivateImportUsage]

    @torch.no_grad()
    def restart(self) -> None:
        """The average started again from the weights as they are (a resumed checkpoint that holds none)."""
        for name, average in self.averages.items():
            local(average).copy_(plain_shard(self.sources[name]))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averages

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The model's trained tensors replaced by their averages inside the block (an evaluation of the
        average), and put back after it; FSDP's gathered copies and the float8 scales precomputed from the weights
        are dropped on the way in and out, so that each forward gathers the shards as they are. One spare copy of
        the rank's shards meanwhile."""
        reshard(self.model)
        kept = {name: plain_shard(tensor).clone() for name, tensor in self.sources.items()}
        for name, tensor in self.sources.items():
            plain_shard(tensor).copy_(local(self.averages[name]))
        forget_float8_scales(self.model)
        try:
            yield
        finally:
            reshard(self.model)
            for name, tensor in self.sources.items():
                plain_shard(tensor).copy_(kept[name])
            forget_float8_scales(self.model)


def plain_shard(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a trained tensor as a plain tensor (the one a weight gathered in float8 wraps), looked up
    at each use: FSDP may give a wrapped shard new storage (its lazy init, a load of a state dict)."""
    return without_float8_wrapper(local(tensor))


def moving_average(model: nn.Module, spec: Optional[EmaSpec]) -> Optional[ShardedEma]:
    """The average the job's `ema` block asks for, of the sharded `model` as it is now; None without one."""
    if spec is None:
        return None
    return ShardedEma(model, spec.decay, spec.every_steps, spec.start_step, spec.warmup)
