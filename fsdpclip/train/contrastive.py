"""OpenCLIP's contrastive losses, `loss.kind` 'clip' (softmax) and 'siglip' (sigmoid): their spec blocks and
their modules over the global batch (OpenCLIP imported when one is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from fsdpclip.jobspec.section import Section
from fsdpclip.jobspec.losses import LOSSES, Loss

if TYPE_CHECKING:
    from torch import nn

    from fsdpclip.jobspec.problems import Report


class ClipLossSpec(Section):
    kind: Literal["clip"] = Field(default="clip", description="Contrastive softmax loss (CLIP).")
    local_loss: bool = Field(
        default=True, description="Each rank computes the loss of its own rows against the global batch.")
    gather_with_grad: bool = Field(
        default=True, description="Gather features with gradient (needed for the exact global-batch gradient).")


class SigLipLossSpec(Section):
    kind: Literal["siglip"] = Field(description="Sigmoid loss (SigLIP); the model needs a learned logit bias.")
    exchange: Literal["bidir", "shift", "reduce", "gather"] = Field(
        default="bidir", description="How text features travel between ranks.")


class ClipKind(Loss):
    name, spec = "clip", ClipLossSpec

    def build(self, spec: ClipLossSpec, rank: int, world_size: int) -> nn.Module:
        from open_clip.loss import ClipLoss

        return ClipLoss(local_loss=spec.local_loss, gather_with_grad=spec.gather_with_grad, cache_labels=True,
                        rank=rank, world_size=world_size)


class SigLipKind(Loss):
    name, spec = "siglip", SigLipLossSpec

    def build(self, spec: SigLipLossSpec, rank: int, world_size: int) -> nn.Module:
        from open_clip.loss import SigLipLoss

        return SigLipLoss(rank=rank, world_size=world_size, dist_impl=spec.exchange)

    def check(self, spec: SigLipLossSpec, model: Any, report: Report) -> None:
        if getattr(model, "logit_bias", None) is None:
            report.error("loss.kind", "SigLIP needs a model with a learned logit bias (init_logit_bias in its config)",
                         value="siglip", hint="use a *-SigLIP model config, or kind 'clip'")


LOSSES.register(ClipKind())
LOSSES.register(SigLipKind())
