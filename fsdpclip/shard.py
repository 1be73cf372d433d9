"""FSDP2 for a built model: which modules become units, and applying fully_shard to them.

`plan_units` is pure (works on the meta device, used by `validate`); the apply functions
take a model and return it changed, in the style of torchtitan's `apply_fsdp`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from fsdpclip.model import Tower, tower_of
from fsdpclip.spec import TOWERS, FsdpSpec


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: a module sharded on its own, with the parameters it owns."""

    module: str  # qualified name; "" is the root
    cls: str
    tower: Optional[str]
    shapes: tuple[torch.Size, ...]
    trainable: int

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def shard_numel(self, world_size: int) -> int:
        """Elements one rank holds: FSDP2 shards each tensor on dim 0, padded to the world size."""
        return sum(math.ceil((s[0] if len(s) else 1) / world_size) * math.prod(s[1:]) for s in self.shapes)


def wrap_classes(fsdp: FsdpSpec, tower: Tower) -> list[str]:
    """The classes of `tower` that become units (default: its blocks)."""
    chosen = getattr(fsdp.wrap, tower.name)
    return list(tower.block_classes) if chosen is None else chosen


def plan_units(model: nn.Module, towers: dict[str, Tower], fsdp: FsdpSpec) -> list[Unit]:
    """Units in the order fully_shard must see them: innermost first, the root last."""
    names: list[tuple[str, str]] = []  # (module name, tower)
    for tower_name in TOWERS:
        classes = set(wrap_classes(fsdp, towers[tower_name]))
        names += [(name, tower_name) for name, module in model.named_modules()
                  if tower_of(name) == tower_name and type(module).__name__ in classes]
    modules = [name for name, _ in names]
    owned: dict[str, list[tuple[torch.Size, bool]]] = {name: [] for name in modules + [""]}
    for pname, param in model.named_parameters():
        owner = max((m for m in modules if pname.startswith(m + ".")), key=len, default="")
        owned[owner].append((param.shape, param.requires_grad))

    def unit(name: str, tower: Optional[str]) -> Unit:
        module = model.get_submodule(name) if name else model
        shapes = tuple(s for s, _ in owned[name])
        trainable = sum(math.prod(s) for s, grad in owned[name] if grad)
        return Unit(name, type(module).__name__, tower, shapes, trainable)

    units = [unit(name, tower) for name, tower in names]
    units.sort(key=lambda u: -u.module.count("."))  # stable: registration order within a depth
    return units + [unit("", None)]
