"""The job's loss (the registered one `loss.kind` names: `fsdpclip.jobspec.losses`), and how the micro batches of
one optimizer step meet it."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from fsdpclip.jobspec.job import LossSpec
from fsdpclip.jobspec.losses import LOSSES


def build_loss(spec: LossSpec, rank: int, world_size: int) -> nn.Module:
    """The loss a job's `loss` block names, over the global batch."""
    return LOSSES[spec.kind].build(spec, rank, world_size)


def backward_micro_batches(model: nn.Module, loss_fn: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                           scale: Optional[Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """Forward and backward of one optimizer step's micro batches; returns the step's loss (detached).

    With several micro batches (`batch.grad_accum`) this is OpenCLIP's `accum_freq`: the features of
    every micro batch are first computed without gradient; then each micro batch runs forward
    again, its features take their place among the cached ones, and the loss over the whole batch
    is backpropagated through them alone. Every micro batch is contrasted against all of it and each
    loss equals the whole batch's loss; the towers' summed gradients are the whole batch's, but the
    temperature and bias, live in every micro batch's loss, get the whole batch's gradient once per
    micro batch (`grad_accum` times it, as in OpenCLIP). It costs one more forward per micro batch
    and keeps every micro batch's inputs until the step ends.
    `scale` is the fp16 loss scaler's (none otherwise).
    """
    if len(batches) == 1:
        loss = loss_fn(*model(*batches[0]))
        (scale(loss) if scale else loss).backward()
        return loss.detach()
    with torch.no_grad():
        cached = [model(images, texts)[:2] for images, texts in batches]
    total = torch.zeros((), device=cached[0][0].device)
    for index, (images, texts) in enumerate(batches):
        image_features, text_features, *rest = model(images, texts)
        image_all = torch.cat([c[0] for c in cached[:index]] + [image_features] + [c[0] for c in cached[index + 1:]])
        text_all = torch.cat([c[1] for c in cached[:index]] + [text_features] + [c[1] for c in cached[index + 1:]])
        loss = loss_fn(image_all, text_all, *rest)
        (scale(loss) if scale else loss).backward()
        total += loss.detach()
    return total / len(batches)
