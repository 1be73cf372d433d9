"""The tower family protocol and its registry: towers of one kind given under `model.<tower>.<name>`
(`fsdpclip.jobspec.registry`).

A tower family is one module (`model/families/NAME.py`, or a plugin's) that subclasses `TowerFamily`, declares
its block (a `Section`) and ends with `TOWER_FAMILIES.register(Family())`. Its module imports nothing heavy when
it loads: building the tower imports torch and OpenCLIP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fsdpclip.jobspec.registry import Registry
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    from fsdpclip.jobspec.problems import Report


class TowerFamily:
    """Towers of one kind for the image or the text tower, given under `model.<tower>.<name>`: `config` is
    the one method to write; the others have defaults."""

    name: str  # its key under model.image / model.text
    tower: str  # 'image' or 'text'
    spec: type[Section]
    description: str = ""  # the spec field's description
    block_classes: tuple[str, ...] = ()  # its repeated blocks' class names (freeze ranges, FSDP units)
    imports: tuple[str, ...] = ()  # optional modules OpenCLIP must import to build it ('transformers')

    def config(self, spec: Section) -> dict:
        """OpenCLIP's vision_cfg or text_cfg for this tower (a ModelError for what cannot be built)."""
        raise NotImplementedError

    def load_weights(self, spec: Section, model: Any) -> None:
        """Load the tower's own initial weights (its spec's files) into `model`; default none."""

    def check(self, spec: Section, report: Report, check_paths: bool) -> None:
        """`validate`'s problems with its files, located under `model.<tower>.<name>`."""

    def paths(self, spec: Section) -> tuple[str, ...]:
        """Its fields that hold local paths (see `DataSource.paths`)."""
        return ()

    def label(self, spec: Section) -> str:
        """A short name of the tower for logs and eval output."""
        return self.name


TOWER_FAMILIES: Registry[TowerFamily] = Registry(
    "tower family", ("fsdpclip.model.families.timm", "fsdpclip.model.families.hf"))
