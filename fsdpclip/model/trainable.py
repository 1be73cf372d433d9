"""What trains and how: the frozen ranges of the spec and the weight-decay groups of its rules.

Both work on original (unwrapped) parameter names and OpenCLIP's shapes, before any wrapping,
on the meta device as on real storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from fsdpclip.model.build import SHARED_PARAMETERS, Tower, find_towers, model_from_config, original_shapes
from fsdpclip.spec.job import DecayRule, FreezeSpec, Job, OptimizerSpec


# -------------------------------------------------------------------------- freeze
def parse_slice(text: str) -> slice:
    """'0:-1' -> slice(0, -1); the spec has already checked the syntax."""
    parts = [p.strip() for p in text.split(":")]
    return slice(*(int(p) if p else None for p in parts))


def slice_problem(text: str, length: int) -> Optional[str]:
    """Why a freeze slice does not fit `length` blocks, or None."""
    chosen = parse_slice(text)
    for bound in (chosen.start, chosen.stop):
        if bound is not None and not -length <= bound <= length:
            return f"index {bound} is out of range for {length} blocks"
    if not range(length)[chosen]:
        return f"selects none of the {length} blocks"
    return None


def frozen_names(towers: dict[str, Tower], freeze: FreezeSpec) -> set[str]:
    """Original names of the parameters the freeze spec turns off."""
    frozen: set[str] = set()
    for tower in towers.values():
        rule = getattr(freeze, tower.name)
        blocks = set(range(len(tower.blocks))[parse_slice(rule.blocks)]) if rule.blocks else set()
        for name in tower.parameters:
            part = tower.part_of(name)
            if (part == "block" and tower.block_of(name) in blocks) or (part == "embeddings" and rule.embeddings) \
                    or (part == "head" and rule.head):
                frozen.add(name)
    if freeze.logit_scale:
        frozen.update(SHARED_PARAMETERS)
    return frozen


def apply_freeze(model: nn.Module, frozen: set[str]) -> None:
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)


def frozen_meta_model(cfg: dict, job: Job) -> tuple[nn.Module, dict[str, Tower]]:
    """The job's model (OpenCLIP config `cfg`) on the meta device with its freeze applied, and its towers."""
    model = model_from_config(cfg, device="meta")
    towers = find_towers(model, job.model.block_classes)
    apply_freeze(model, frozen_names(towers, job.freeze))
    return model, towers


# --------------------------------------------------------------------- weight decay
def rule_matches(rule: DecayRule, name: str, ndim: int) -> bool:
    return (rule.pattern is None or re.search(rule.pattern, name) is not None) and \
        (rule.max_ndim is None or ndim <= rule.max_ndim)


@dataclass
class DecayGroup:
    """Parameters sharing one weight decay; `rule` is the index of the rule that chose it (None: default)."""

    weight_decay: float
    rule: Optional[int]
    names: list[str] = field(default_factory=list)


def decay_groups(shapes: dict[str, torch.Size], rules: list[DecayRule], default_decay: float) -> list[DecayGroup]:
    """Split parameters (original name -> shape) into groups by the first matching rule."""
    groups: dict[Optional[int], DecayGroup] = {}
    for name, shape in shapes.items():
        index = next((i for i, rule in enumerate(rules) if rule_matches(rule, name, len(shape))), None)
        decay = rules[index].weight_decay if index is not None else default_decay
        groups.setdefault(index, DecayGroup(decay, index)).names.append(name)
    return [groups[k] for k in sorted(groups, key=lambda k: (k is None, k if k is not None else 0))]


def trainable_decay_groups(model: nn.Module, spec: OptimizerSpec) -> list[DecayGroup]:
    """The decay groups of the trainable parameters of `model` (freeze applied), by original name."""
    shapes = original_shapes(model)
    trainable = {name: shapes[name] for name, p in model.named_parameters() if p.requires_grad}
    return decay_groups(trainable, spec.decay_rules, spec.weight_decay)
