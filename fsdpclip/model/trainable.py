"""What trains and how: the frozen ranges of the spec, the weight-decay groups of its rules and the layer-wise
LR decay of its towers.

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
from fsdpclip.spec.job import DecayRule, FreezeSpec, Job, LayerDecaySpec, OptimizerSpec


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
    """Parameters sharing one weight decay and LR scale; `rule` is the index of the rule that chose the decay
    (None: default)."""

    weight_decay: float
    rule: Optional[int]
    names: list[str] = field(default_factory=list)
    lr_scale: float = 1.0


def decay_groups(shapes: dict[str, torch.Size], rules: list[DecayRule], default_decay: float,
                 lr_scales: Optional[dict[str, float]] = None) -> list[DecayGroup]:
    """Split parameters (original name -> shape) into groups by the first matching rule and their LR scale
    (`lr_scales`, 1 where absent): by rule, then the largest scale first."""
    groups: dict[tuple[Optional[int], float], DecayGroup] = {}
    for name, shape in shapes.items():
        index = next((i for i, rule in enumerate(rules) if rule_matches(rule, name, len(shape))), None)
        decay = rules[index].weight_decay if index is not None else default_decay
        scale = (lr_scales or {}).get(name, 1.0)
        groups.setdefault((index, scale), DecayGroup(decay, index, lr_scale=scale)).names.append(name)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0] is None, k[0] or 0, -k[1]))]


def trainable_decay_groups(model: nn.Module, towers: dict[str, Tower], spec: OptimizerSpec) -> list[DecayGroup]:
    """The decay groups of the trainable parameters of `model` (freeze applied), by original name."""
    shapes = original_shapes(model)
    trainable = {name: shapes[name] for name, p in model.named_parameters() if p.requires_grad}
    return decay_groups(trainable, spec.decay_rules, spec.weight_decay, layer_lr_scales(towers, spec.layer_decay))


# ------------------------------------------------------------- layer-wise LR decay
FINAL_NORM_RE = re.compile(r"^(visual\.|text\.)?(ln_post|ln_final)\.")  # OpenCLIP's, grouped with the last block


def layer_ids(tower: Tower) -> dict[str, int]:
    """Each parameter's depth in its tower (original name -> id), as OpenCLIP main's `layer_groups` order it from
    input to output: the embeddings 0, block i at i + 1 with the final norm in the last block's group, the rest of
    the head (the projection, a pooler) at the top."""
    last = len(tower.blocks)
    ids = {}
    for name in tower.parameters:
        part = tower.part_of(name)
        ids[name] = 0 if part == "embeddings" else tower.block_of(name) + 1 if part == "block" else \
            last if FINAL_NORM_RE.search(name) else last + 1
    return ids


def layer_lr_scales(towers: dict[str, Tower], decay: LayerDecaySpec) -> dict[str, float]:
    """The LR multiplier of each parameter of the towers that `decay` names: decay^(top − id), the top being the
    tower's highest id (1 for its head). By position, as open_clip_train's `lr_scales_for_groups` (OpenCLIP main,
    src/open_clip_train/optim.py). Other parameters (an undecayed tower's, the temperature) are absent: 1."""
    scales = {}
    for tower in towers.values():
        factor = getattr(decay, tower.name)
        if factor is None:
            continue
        ids = layer_ids(tower)
        top = max(ids.values(), default=0)
        scales.update((name, factor ** (top - depth)) for name, depth in ids.items())
    return scales
