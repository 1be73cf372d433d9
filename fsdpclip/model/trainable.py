"""What trains and how: the frozen ranges of the spec, the weight-decay groups of its rules and the layer-wise
LR decay of its towers.

Both work on original (unwrapped) parameter names and OpenCLIP's shapes, before any wrapping,
on the meta device as on real storage.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import nn

from fsdpclip.model.build import SHARED_PARAMETERS, OpenClip, Tower, find_towers, model_from_config, original_shapes
from fsdpclip.jobspec.problems import ModelError
from fsdpclip.jobspec.job import TOWERS, DecayRule, FreezeSpec, Job, LayerDecaySpec, OptimizerSpec


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


def trainable_decay_groups(model: nn.Module, spec: OptimizerSpec) -> list[DecayGroup]:
    """The decay groups of the trainable parameters of `model` (freeze applied), by original name."""
    shapes = original_shapes(model)
    trainable = {name: shapes[name] for name, p in model.named_parameters() if p.requires_grad}
    return decay_groups(trainable, spec.decay_rules, spec.weight_decay, layer_lr_scales(model, spec.layer_decay))


# ------------------------------------------------------------- layer-wise LR decay
# The towers OpenCLIP main gives layer groups (`layer_groups()` in src/open_clip), as a refusal names them.
GROUPED_TOWERS = "OpenCLIP's VisionTransformer, ModifiedResNet, TextTransformer, HFTextEncoder and timm trunks " \
                 "with a group_matcher"
# Main's hf_configs.py: where each Hugging Face architecture keeps its token embeddings and its encoder's layers
# (token_embeddings_attr, layer_attr; the installed OpenCLIP lacks BERT's and M2M-100's; T5 is built as mT5).
HF_LAYERS = {"roberta": ("embeddings", "layer"), "xlm-roberta": ("embeddings", "layer"),
             "bert": ("embeddings", "layer"), "mt5": ("embed_tokens", "block"), "t5": ("embed_tokens", "block"),
             "m2m_100": ("embed_tokens", "layers")}
Member = Union[nn.Module, nn.Parameter]  # of a layer group, as main's groups hold them


def layer_groups(model: OpenClip, tower: str) -> Optional[list[list[str]]]:
    """OpenCLIP main's layer groups of one tower of `model` ('image' or 'text'), input to output, as original
    parameter names: its towers' `layer_groups()` (src/open_clip; the text pooler in the head, main's default).
    Parameters in no group (a ViT's attention pool, a T5 encoder's final norm) are absent. None for a tower main
    has no groups for."""
    names = {id(p): name for name, p in model.named_parameters()}
    groups = image_members(model.visual) if tower == "image" else text_members(getattr(model, "text", model))
    if groups is None:
        return None
    return [[names[id(p)] for member in members for p in parameters_of(member)] for members in groups]


def parameters_of(member: Member) -> list[nn.Parameter]:
    return [member] if isinstance(member, nn.Parameter) else list(member.parameters())


def image_members(visual: OpenClip) -> Optional[list[list[Member]]]:
    """Main's groups of an image tower: VisionTransformer's (the embeddings, each block with ln_post in the last,
    the projection), ModifiedResNet's (the stem, the 4 stages, the attention pool) and TimmModel's (timm's own
    `group_matcher` over the trunk, then OpenCLIP's head where it has parameters); None for any other."""
    from open_clip.modified_resnet import ModifiedResNet
    from open_clip.timm_model import TimmModel
    from open_clip.transformer import VisionTransformer

    if isinstance(visual, VisionTransformer):
        embeddings = [visual.conv1, getattr(visual, "class_embedding", None),
                      getattr(visual, "positional_embedding", None), visual.ln_pre]
        return [[m for m in embeddings if m is not None], *blocks_with_final_norm(visual.transformer, visual.ln_post),
                *([[visual.proj]] if visual.proj is not None else [])]
    if isinstance(visual, ModifiedResNet):
        stem = [visual.conv1, visual.bn1, visual.conv2, visual.bn2, visual.conv3, visual.bn3]
        return [stem, [visual.layer1], [visual.layer2], [visual.layer3], [visual.layer4], [visual.attnpool]]
    if isinstance(visual, TimmModel) and hasattr(visual.trunk, "group_matcher"):
        from timm.models import group_parameters

        trunk: OpenClip = visual.trunk
        by_layer = group_parameters(trunk, trunk.group_matcher())
        head: list[list[Member]] = [[visual.head]] if parameters_of(visual.head) else []
        return [[trunk.get_parameter(name) for name in by_layer[layer]] for layer in sorted(by_layer)] + head
    return None


def text_members(text: OpenClip) -> Optional[list[list[Member]]]:
    """Main's groups of a text tower: OpenCLIP's own, on CLIP or a TextTransformer (the embeddings, each block
    with ln_final in the last, the projection), and HFTextEncoder's (the encoder's embeddings, each layer, the
    pooler with the projection); None for any other."""
    from open_clip import CLIP
    from open_clip.hf_model import HFTextEncoder
    from open_clip.transformer import TextTransformer

    if isinstance(text, (CLIP, TextTransformer)):
        tower: OpenClip = text  # its parts, by name
        first: list[Member] = [m for m in (tower.token_embedding, tower.positional_embedding,
                                           getattr(tower, "cls_emb", None)) if m is not None]
        return [first, *blocks_with_final_norm(tower.transformer, tower.ln_final),
                *([[tower.text_projection]] if tower.text_projection is not None else [])]
    model_type = getattr(text.config, "model_type", None) if isinstance(text, HFTextEncoder) else None
    if model_type in HF_LAYERS:
        embeddings, layers = HF_LAYERS[model_type]
        encoder = getattr(text.transformer, "encoder", text.transformer)
        pooler = getattr(text.transformer, "pooler", None)
        head: list[Member] = [m for m in (pooler, text.proj) if m is not None and parameters_of(m)]
        return [[getattr(text.transformer, embeddings)], *([layer] for layer in getattr(encoder, layers)),
                *([head] if head else [])]
    return None


def blocks_with_final_norm(transformer: OpenClip, final_norm: OpenClip) -> list[list[Member]]:
    groups: list[list[Member]] = [[block] for block in transformer.resblocks]
    if groups:
        groups[-1].append(final_norm)
    return groups


def layer_lr_scales(model: nn.Module, decay: LayerDecaySpec) -> dict[str, float]:
    """The LR multiplier of each parameter of the towers that `decay` names: decay^(depth below the top group), by
    position in `layer_groups`, as open_clip_train's `lr_scales_for_groups` (OpenCLIP main,
    src/open_clip_train/optim.py; a decay of 1 is off there). Other parameters (in no group, an undecayed tower's,
    the temperature) are absent: 1. A tower without groups is a ModelError at optimizer.layer_decay.<tower>."""
    scales = {}
    for tower in TOWERS:
        factor = getattr(decay, tower)
        if factor is None or factor == 1.0:
            continue
        groups = layer_groups(model, tower)
        if groups is None:
            module = model.visual if tower == "image" else getattr(model, "text", model)
            raise ModelError(f"OpenCLIP main has no layer groups for this {tower} tower "
                             f"({type(getattr(module, 'trunk', module)).__name__})", f"optimizer.layer_decay.{tower}",
                             factor, hint=f"layer decay covers {GROUPED_TOWERS}")
        scales.update((name, factor ** (len(groups) - 1 - depth)) for depth, group in enumerate(groups)
                      for name in group)
    return scales
