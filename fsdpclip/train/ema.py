"""An exponential moving average of the trained weights, kept sharded as the weights are (`ShardedEma`).

timm's `ModelEmaV3` (what open_clip main uses, and refuses under FSDP2) keeps a deep copy of the whole model.
Here each rank averages only its own shards: the average of a parameter is a float32 DTensor of the
parameter's mesh and placements, so no rank holds a full copy, a checkpoint saves and reshards it as it does
the weights, and its update is one fused lerp over the rank's local tensors. Frozen parameters are left out
(their average is themselves); floating-point buffers (a ResNet tower's batch-norm statistics) are averaged
too, as timm does.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from fsdpclip.train.optim import local


def ema_decay(step: int, decay: float, start_step: int = 0, warmup: bool = False) -> float:
    """The decay of the update after optimizer step `step` (counted from 1): timm's `ModelEmaV3.get_decay`
    (0, a plain copy, up to `start_step` + 1; with `warmup`, its 1 - (1 + n)^(-2/3) ramp, capped at `decay`)."""
    n = max(0, step - start_step - 1)
    if n <= 0:
        return 0.0
    return min(1 - (1 + n) ** (-2 / 3), decay) if warmup else decay


def averaged_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What an average covers, by state-dict name: the trained parameters and the floating-point buffers."""
    tensors: dict[str, torch.Tensor] = {name: p for name, p in model.named_parameters() if p.requires_grad}
    tensors.update((name, buffer) for name, buffer in model.named_buffers() if buffer.is_floating_point())
    return tensors


class ShardedEma:
    """The moving average of `model`'s trained tensors after each `every_steps`-th optimizer step (see
    `ema_decay`); `state_dict()` is its part of a checkpoint."""

    def __init__(self, model: nn.Module, decay: float, every_steps: int = 1, start_step: int = 0,
                 warmup: bool = False):
        self.decay, self.every_steps, self.start_step, self.warmup = decay, every_steps, start_step, warmup
        self.sources = averaged_tensors(model)
        with torch.no_grad():
            self.averages = {name: t.detach().to(torch.float32, copy=True) for name, t in self.sources.items()}

    @torch.no_grad()
    def update(self, step: int) -> None:
        """Average in the weights as they are after optimizer step `step` (from 1), if that step is one to."""
        if step % self.every_steps:
            return
        names = list(self.averages)
        averages = [local(self.averages[name]) for name in names]
        sources = [local(self.sources[name]).to(torch.float32) for name in names]
        weight = 1.0 - ema_decay(step, self.decay, self.start_step, self.warmup)
        torch._foreach_lerp_(averages, sources, weight)  # pyright: ignore[reportPrivateImportUsage]  (torch's private kernels)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.averages

    @contextlib.contextmanager
    @torch.no_grad()
    def swapped_in(self) -> Iterator[None]:
        """The model's trained tensors replaced by their averages inside the block (an evaluation of the
        average), and put back after it; one spare copy of the rank's shards meanwhile."""
        kept = {name: local(tensor).clone() for name, tensor in self.sources.items()}
        for name, tensor in self.sources.items():
            local(tensor).copy_(local(self.averages[name]))
        try:
            yield
        finally:
            for name, tensor in self.sources.items():
                local(tensor).copy_(kept[name])
