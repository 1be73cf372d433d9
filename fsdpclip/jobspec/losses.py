"""The loss protocol and its registry (`fsdpclip.jobspec.registry`): the losses a spec names by `loss.kind`.

A loss is one module (or a plugin's) that subclasses `Loss`, declares its `loss` block (a `Section` with
`kind: Literal[NAME]`) and ends with `LOSSES.register(Kind())`; OpenCLIP's CLIP and SigLIP losses are the
built-in ones (`fsdpclip.train.contrastive`). Its module imports nothing heavy when it loads: `build` imports
torch and OpenCLIP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdpclip.jobspec.registry import Registry
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    from torch import nn

    from fsdpclip.jobspec.problems import Report


class Loss:
    """A loss named by `loss.kind`: `build` is the one method to write; the others have defaults."""

    name: str  # the `loss.kind` value that selects it
    spec: type[Section]  # its `loss` block, with `kind: Literal[name]`

    def build(self, spec: Section, rank: int, world_size: int) -> nn.Module:
        """The loss of the global batch on rank `rank` of `world_size`: a module called with the model's outputs
        (image features, text features, logit scale and, where the model has one, logit bias), returning a
        scalar."""
        raise NotImplementedError

    def check(self, spec: Section, model: Any, report: Report) -> None:
        """`validate`'s problems with this loss for the model (on the meta device), located under `loss`."""

    def paths(self, spec: Section) -> tuple[str, ...]:
        """Its fields that hold local paths (see `jobspec.source.DataSource.paths`)."""
        return ()


LOSSES: Registry[Loss] = Registry("loss", ("fsdpclip.train.contrastive",))
