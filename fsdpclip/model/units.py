"""Which modules of a built model become FSDP units, and which recompute their activations.

Pure planning on original module names: works on the meta device (`validate` uses it) and
changes nothing; `fsdpclip.parallel.parallelize` applies the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import nn

from fsdpclip.model.build import Tower, instances, tower_of
from fsdpclip.jobspec.job import TOWERS, FsdpSpec


# 'auto' unit size: per-unit overhead is fixed, so large units amortise it. On 2×H200 the
# fastest units were whole towers for ViT-B-32/ViT-L-14 and ~400M parameters for ViT-bigG-14
# (docs/performance.md); two gathered units of that size in bf16 take ~2 GiB.
AUTO_UNIT_PARAMETERS = 400_000_000
# Towers up to this size are one unit compiled whole under compile 'auto': kept gathered after forward, a
# tower costs 2 bytes per parameter more. 1×H200, one run each (docs/performance.md): ViT-H-14
# (632M-parameter image tower) at 64/GPU 352 samples/s against 262 eager, ViT-L-14 at 128/GPU 789 against
# 756 with each block compiled. Larger towers (ViT-bigG-14's 1.8B) keep their ~400M units.
WHOLE_TOWER_MAX_PARAMETERS = 1_000_000_000


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: modules sharded together (one all-gather), with the parameters they own."""

    modules: tuple[str, ...]  # qualified names; ("",) is the root
    cls: str
    tower: Optional[str]
    shapes: tuple[torch.Size, ...]
    trainable: int

    @property
    def is_root(self) -> bool:
        return self.modules == ("",)

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def shard_numel(self, world_size: int) -> int:
        """Elements one rank holds: FSDP2 shards each tensor on dim 0, padded to the world size."""
        return sum(math.ceil((s[0] if len(s) else 1) / world_size) * math.prod(s[1:]) for s in self.shapes)


@dataclass(frozen=True)
class Layout:
    """The FSDP units of a model and how they run, with `fsdp`'s 'auto' settled (`plan.resolved`): per tower,
    the classes that become units (None: its blocks) and how many of them one unit holds; whether units free
    their gathered parameters after forward, whether they are compiled, and whether the linear layers of their blocks
    run in float8 (`model.float8`)."""

    wrap: dict[str, Optional[tuple[str, ...]]]
    unit_size: dict[str, int]
    reshard_after_forward: bool = True
    compile: bool = False
    float8: bool = False


def wrap_classes(wrap: Optional[Sequence[str]], tower: Tower) -> list[str]:
    """The classes of `tower` that become units: `wrap`, else its blocks."""
    return list(tower.block_classes) if wrap is None else list(wrap)


def checkpointed_modules(model: nn.Module, towers: dict[str, Tower], fsdp: FsdpSpec) -> list[str]:
    """Names of the modules whose activations are recomputed: the outermost instances of each
    tower's configured classes (true: its block classes)."""
    names = []
    for tower in towers.values():
        chosen = getattr(fsdp.activation_checkpointing, tower.name)
        classes = list(tower.block_classes) if chosen is True else (chosen or [])
        names += instances(model.named_modules(), tower.name, classes)
    return names


def blocks_per_unit(model: nn.Module, tower: Tower, wrap: Optional[Sequence[str]], unit_size) -> int:
    """`unit_size` for `tower`, with 'auto' resolved to about AUTO_UNIT_PARAMETERS per unit (counted on its
    first unit-class module)."""
    if unit_size != "auto":
        return unit_size
    outer = instances(model.named_modules(), tower.name, wrap_classes(wrap, tower))
    if not outer:
        return 1
    block = sum(p.numel() for p in model.get_submodule(outer[0]).parameters())
    return max(1, round(AUTO_UNIT_PARAMETERS / max(1, block)))


def plan_units(model: nn.Module, towers: dict[str, Tower], layout: Layout) -> list[Unit]:
    """Units in the order fully_shard must see them: innermost first, the root last.

    With more than one block per unit, consecutive outermost wrap-class modules of a tower
    share one unit; with one, every wrap-class module (nested ones too) is its own unit.
    """
    groups: list[tuple[tuple[str, ...], str]] = []  # (module names, tower)
    for tower_name in TOWERS:
        classes = set(wrap_classes(layout.wrap[tower_name], towers[tower_name]))
        outer = instances(model.named_modules(), tower_name, classes)
        size = layout.unit_size[tower_name] if outer else 1
        if size == 1:
            groups += [((name,), tower_name) for name, module in model.named_modules()
                       if tower_of(name) == tower_name and type(module).__name__ in classes]
        else:
            groups += [(tuple(outer[i:i + size]), tower_name) for i in range(0, len(outer), size)]
    unit_of = {name: index for index, (names, _) in enumerate(groups) for name in names}
    owned: list[list[tuple[torch.Size, bool]]] = [[] for _ in range(len(groups) + 1)]
    for pname, param in model.named_parameters():
        owner = max((m for m in unit_of if pname.startswith(m + ".")), key=len, default=None)
        owned[unit_of[owner] if owner is not None else -1].append((param.shape, param.requires_grad))

    def unit(names: tuple[str, ...], tower: Optional[str], parameters) -> Unit:
        module = model.get_submodule(names[0]) if names[0] else model
        trainable = sum(math.prod(s) for s, grad in parameters if grad)
        return Unit(names, type(module).__name__, tower, tuple(s for s, _ in parameters), trainable)

    units = [unit(names, tower, owned[i]) for i, (names, tower) in enumerate(groups)]
    units.sort(key=lambda u: -u.modules[0].count("."))  # stable: registration order within a depth
    return units + [unit(("",), None, owned[-1])]


def whole_tower_wraps(model: nn.Module, towers: dict[str, Tower], fsdp: FsdpSpec) -> Optional[dict[str, list[str]]]:
    """The wrap classes that make each tower's block container (the module holding exactly its
    blocks, OpenCLIP's `Transformer`) one unit, where `fsdp` has its defaults (no wrap classes, 'auto'
    unit size, no activation checkpointing or offload) and every tower's blocks hold at most
    WHOLE_TOWER_MAX_PARAMETERS; None otherwise. Such a unit can be compiled whole: FSDP's hooks stay
    outside it."""
    if (fsdp.wrap.image is not None or fsdp.wrap.text is not None or fsdp.unit_size != "auto" or fsdp.cpu_offload
            or fsdp.activation_checkpointing.image or fsdp.activation_checkpointing.text):
        return None
    wraps = {}
    for name, tower in towers.items():
        blocks = tower.blocks
        if not blocks or blocks[0].count(".") < 2:
            return None
        container = blocks[0].rsplit(".", 2)[0]
        module = model.get_submodule(container)
        cls = type(module).__name__
        in_blocks = sum(p.numel() for block in blocks for p in model.get_submodule(block).parameters())
        if (in_blocks > WHOLE_TOWER_MAX_PARAMETERS or not all(block.startswith(container + ".") for block in blocks)
                or sum(p.numel() for p in module.parameters()) != in_blocks
                or instances(model.named_modules(), name, [cls]) != [container]):
            return None
        wraps[name] = [cls]
    return wraps
