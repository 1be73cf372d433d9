"""A plain single-process reference for the trainer, written from OpenCLIP's own pieces: its CLIP
model class, `ClipLoss` and `SigLipLoss`, open_clip_train's learning-rate schedules and `accum_freq`
logic, `torch.optim.AdamW`, `torch.nn.utils.clip_grad_norm_` and `torch.amp.GradScaler`.

W ranks are played in one process. Each rank has its own copy of the model in the compute dtype
(what FSDP's mixed precision gives every rank) and its own micro batches; its loss sees the other
ranks' features as OpenCLIP's collectives would hand them over (gathered with or without gradient;
SigLIP's exchanged text features with gradient); the copies' gradients are averaged (FSDP's
reduce-scatter, in the reduce dtype) into the fp32 master model, which torch's fused AdamW steps (the same arithmetic as the
trainer's kernel: the unfused one differs by rounding that Adam's normalisation of near-zero
gradients, such as attention key biases', amplifies to ~1e-4 of a weight's movement); likewise the copies
compute the ViT's patch embedding as the trainer does (`fsdp.direct_patch_embedding`: a matmul, the same
function as OpenCLIP's convolution by tests/test_direct.py, rounded differently in bf16). The learned
temperature and bias are the master's own fp32 parameters in every copy, as OpenCLIP keeps them
under autocast. What the spec's freeze ranges and decay rules mean is given by the caller, written
independently of fsdpclip; layer-wise LR decay is OpenCLIP main's, copied below (`open_clip_main_lr_scales`)
because the installed OpenCLIP predates it.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
from open_clip import loss as open_clip_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LOGIT_SCALE_MAX = math.log(100)


@dataclass
class Reference:
    """What the reference trained: the mean loss and the gradient norm of each step, the final weights."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    state: dict = field(default_factory=dict)
    scale: Optional[float] = None


@contextlib.contextmanager
def gathered_as_rank(features: list[tuple[torch.Tensor, torch.Tensor]], rank: int):
    """`open_clip.loss.gather_features` as rank `rank` would see it: every rank's features, those of the
    other ranks with gradient only when gathered with gradient (and its own unless local loss
    gathers them all without)."""

    def gather(image_features, text_features, local_loss=False, gather_with_grad=False, rank=rank, world_size=1,
               use_horovod=False):
        def kept(q: int, tensor: torch.Tensor) -> torch.Tensor:
            with_grad = gather_with_grad or (q == rank and not local_loss)
            return tensor if with_grad else tensor.detach()

        return (torch.cat([kept(q, f[0]) for q, f in enumerate(features)]),
                torch.cat([kept(q, f[1]) for q, f in enumerate(features)]))

    original = open_clip_loss.gather_features
    open_clip_loss.gather_features = gather
    try:
        yield
    finally:
        open_clip_loss.gather_features = original


def rank_losses(loss_spec, features: list[tuple[torch.Tensor, torch.Tensor]], extras: list[list]) -> list[torch.Tensor]:
    """Each rank's loss, as OpenCLIP's ClipLoss / SigLipLoss computes it on that rank from its features
    and its forward's temperature (and bias)."""
    world, losses = len(features), []
    for rank, ((images, texts), extra) in enumerate(zip(features, extras)):
        scale, bias = (extra + [None])[:2]
        if loss_spec.kind == "clip":
            loss_fn = open_clip_loss.ClipLoss(local_loss=loss_spec.local_loss, gather_with_grad=loss_spec.gather_with_grad,
                                              rank=rank, world_size=world)
            with gathered_as_rank(features, rank):
                losses.append(loss_fn(images, texts, scale))
        else:  # every exchange delivers the other ranks' text features, with gradient
            pairs = open_clip_loss.SigLipLoss()
            loss = pairs._loss(images, texts, scale, bias)
            for other, (_, their_texts) in enumerate(features):
                if other != rank:
                    loss = loss + pairs._loss(images, their_texts, scale, bias, negative_only=True)
            losses.append(loss)
    return losses


def rank_copy(master: torch.nn.Module, dtype: torch.dtype, direct_patches: bool) -> torch.nn.Module:
    """One rank's working copy in the compute dtype; temperature and bias stay the master's fp32 ones."""
    from fsdpclip.model.fast_modules import use_direct_patch_embedding

    replica = copy.deepcopy(master).to(dtype)
    if direct_patches:
        use_direct_patch_embedding(replica)
    for name in ("logit_scale", "logit_bias"):
        if getattr(master, name, None) is not None:
            setattr(replica, name, getattr(master, name))
    return replica


def schedule(job, optimizer, total_steps: int) -> Callable[[int], float]:
    """open_clip_train's schedule for the spec (cosine with a floor written from its definition)."""
    from open_clip_train.scheduler import const_lr, cosine_lr

    spec, lr = job.schedule, job.optimizer.lr
    if spec.kind == "constant":
        return const_lr(optimizer, lr, spec.warmup_steps, total_steps)
    if spec.min_lr == 0:
        return cosine_lr(optimizer, lr, spec.warmup_steps, total_steps)

    def floored(step: int) -> float:
        if step < spec.warmup_steps:
            value = lr * (step + 1) / spec.warmup_steps
        else:
            progress = (step - spec.warmup_steps) / (total_steps - spec.warmup_steps)
            value = spec.min_lr + (lr - spec.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
        for group in optimizer.param_groups:
            group["lr"] = value
        return value

    return floored


def scaled(adjust: Callable[[int], float], optimizer) -> Callable[[int], float]:
    """The schedule with each group's LR times its `lr_scale`, as OpenCLIP main's `assign_learning_rate`
    (src/open_clip_train/scheduler.py) sets it."""
    def step(index: int) -> float:
        lr = adjust(index)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        return lr

    return step


def reference_run(job, model: torch.nn.Module, world: int, batch: Callable[[int, int], tuple],
                  frozen: Callable[[str], bool], weight_decay: Callable[[str, torch.Tensor], float],
                  steps: int, poison: Optional[tuple[int, int]] = None,
                  lr_scales: Optional[dict[str, float]] = None) -> Reference:
    """Train `model` (OpenCLIP's, with its initial weights) as the spec asks, on `world` simulated ranks.

    `batch(rank, index)` gives a rank's micro batch `index`; `poison` = (step, rank) makes that rank's
    loss infinite at that step (1-based), as an fp16 overflow would; `lr_scales` (name -> scale, 1 where
    absent) splits the groups further and scales each group's LR, as OpenCLIP main's layer decay does.
    """
    dtype, reduce_dtype = DTYPES[job.fsdp.param_dtype], DTYPES[job.fsdp.reduce_dtype]
    accum, spec = job.batch.grad_accum, job.optimizer
    for name, param in model.named_parameters():
        param.requires_grad_(not frozen(name))
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    scale_of = lambda name: (lr_scales or {}).get(name, 1.0)  # noqa: E731
    keys = sorted({(weight_decay(n, p), scale_of(n)) for n, p in trainable})
    optimizer = torch.optim.AdamW([{"params": [p for n, p in trainable if (weight_decay(n, p), scale_of(n)) == key],
                                    "weight_decay": key[0], "lr_scale": key[1]} for key in keys],
                                  lr=spec.lr, betas=spec.betas, eps=spec.eps, fused=True)
    adjust = scaled(schedule(job, optimizer, steps), optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=job.fsdp.grad_scaler.init_scale,
                                  growth_interval=job.fsdp.grad_scaler.growth_interval) \
        if job.fsdp.param_dtype == "fp16" else None
    result = Reference()
    for step in range(steps):
        adjust(step)
        copies = [rank_copy(model, dtype, job.fsdp.direct_patch_embedding) for _ in range(world)]
        micro = [[batch(rank, step * accum + j) for j in range(accum)] for rank in range(world)]
        infinite = poison is not None and poison[0] == step + 1
        loss = _accumulated_backward(job, copies, micro, dtype, scaler, poison[1] if infinite else None)
        _average_into(model, copies, reduce_dtype, world)
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_([p for _, p in trainable], spec.grad_clip_norm or math.inf)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        elif torch.isfinite(norm):  # the spec's on_nonfinite 'skip'
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        result.losses.append(loss)
        result.norms.append(norm.item())
    result.state = {k: v.clone() for k, v in model.state_dict().items()}
    result.scale = scaler.get_scale() if scaler is not None else None
    return result


def _accumulated_backward(job, copies, micro, dtype, scaler, poisoned_rank: Optional[int]) -> float:
    """Forward and backward of one step over every rank's micro batches (open_clip_train's accum_freq
    when there are several); returns the step's loss, the mean over ranks."""
    def forward(replica, images, texts):
        """(features, temperature and bias) as the sharded model returns them: outputs in fp32."""
        outputs = [o.float() for o in replica(images.to(dtype), texts)]
        return outputs[:2], outputs[2:]

    def backward(features, extras) -> float:
        losses = rank_losses(job.loss, features, extras)
        if poisoned_rank is not None:
            losses[poisoned_rank] = losses[poisoned_rank] * float("inf")
        total = sum(losses)
        (scaler.scale(total) if scaler is not None else total).backward()
        return total.item() / len(losses)

    accum = len(micro[0])
    if accum == 1:
        outputs = [forward(replica, *batches[0]) for replica, batches in zip(copies, micro)]
        return backward([f for f, _ in outputs], [e for _, e in outputs])
    with torch.no_grad():
        cached = [[forward(replica, *b)[0] for b in batches] for replica, batches in zip(copies, micro)]
    total = 0.0
    for j in range(accum):
        features, extras = [], []
        for replica, batches, cache in zip(copies, micro, cached):
            live, extra = forward(replica, *batches[j])
            features.append(tuple(torch.cat([c[k] for c in cache[:j]] + [live[k]] + [c[k] for c in cache[j + 1:]])
                                  for k in range(2)))
            extras.append(extra)
        total += backward(features, extras)
    return total / accum


def _average_into(model, copies, reduce_dtype: torch.dtype, world: int) -> None:
    """The copies' gradients, averaged in the reduce dtype, become the master's (the shared temperature
    and bias already hold the sum over ranks)."""
    replicas = [dict(c.named_parameters()) for c in copies]
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if name in ("logit_scale", "logit_bias"):
            if param.grad is not None:
                param.grad = param.grad / world
            continue
        grads = [r[name].grad for r in replicas]
        param.grad = sum((g.to(reduce_dtype) / world for g in grads), torch.zeros_like(grads[0], dtype=reduce_dtype)).float()


def open_clip_train_no_decay(name: str, param: torch.Tensor) -> bool:
    """open_clip_train's own exclusion from weight decay (its main.py), which the default rules follow."""
    return param.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name


def open_clip_train_optimizer(model: torch.nn.Module, lr: float, betas: tuple[float, float], eps: float,
                              wd: float) -> torch.optim.AdamW:
    """AdamW as open_clip_train's main.py builds it: the trained parameters without weight decay, then the
    rest, each in `named_parameters()` order."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return torch.optim.AdamW([{"params": [p for n, p in named if open_clip_train_no_decay(n, p)], "weight_decay": 0.0},
                              {"params": [p for n, p in named if not open_clip_train_no_decay(n, p)], "weight_decay": wd}],
                             lr=lr, betas=betas, eps=eps)


def open_clip_model(config_path: Path, seed: int) -> torch.nn.Module:
    """OpenCLIP's own model for a config file, initialised as the trainer initialises it for `seed`."""
    import open_clip

    torch.manual_seed(seed)
    return open_clip.CLIP(**json.loads(Path(config_path).read_text()))


# OpenCLIP main's layer-wise LR decay, copied from mlfoundations/open_clip at 89fb801f (2026-06-27):
# src/open_clip/transformer.py (VisionTransformer.layer_groups, _text_layer_groups),
# src/open_clip/modified_resnet.py, src/open_clip/timm_model.py and src/open_clip/hf_model.py (their
# layer_groups, the HF pooler in the head as main's default --text-pooler-in-head) and
# src/open_clip_train/optim.py (lr_scales_for_groups, _assign_group_scales, layer_decay_param_groups' default 1.0).
def _vision_layer_groups(visual):
    embed = [
        m for m in (
            visual.conv1,
            getattr(visual, "class_embedding", None),
            getattr(visual, "positional_embedding", None),
            visual.ln_pre,
        )
        if m is not None
    ]
    groups = [("embeddings", embed)]
    resblocks = visual.transformer.resblocks
    n = len(resblocks)
    for i, block in enumerate(resblocks):
        members = [block]
        if i == n - 1:
            members.append(visual.ln_post)
        groups.append((f"layer.{i}", members))
    if visual.proj is not None:
        groups.append(("proj", [visual.proj]))
    return groups


def _resnet_layer_groups(visual):
    groups = [
        ("embeddings", [visual.conv1, visual.bn1, visual.conv2, visual.bn2, visual.conv3, visual.bn3]),
        ("layer.0", [visual.layer1]),
        ("layer.1", [visual.layer2]),
        ("layer.2", [visual.layer3]),
        ("layer.3", [visual.layer4]),
    ]
    if visual.attnpool is not None:
        groups.append(("proj", [visual.attnpool]))
    return groups


def _timm_layer_groups(visual):
    from timm.models.helpers import group_parameters
    matcher = visual.trunk.group_matcher()
    gparams = group_parameters(visual.trunk, matcher)
    groups = []
    for layer_id in sorted(gparams.keys()):
        members = [visual.trunk.get_parameter(name) for name in gparams[layer_id]]
        groups.append((f"layer.{layer_id}", members))
    if next(visual.head.parameters(), None) is not None:
        groups.append(("proj", [visual.head]))
    return groups


_HF_CONFIG_NAMES = {  # src/open_clip/hf_configs.py's token_embeddings_attr and layer_attr (T5: mT5's)
    "roberta": {"layer_attr": "layer", "token_embeddings_attr": "embeddings"},
    "xlm-roberta": {"layer_attr": "layer", "token_embeddings_attr": "embeddings"},
    "mt5": {"layer_attr": "block", "token_embeddings_attr": "embed_tokens"},
    "t5": {"layer_attr": "block", "token_embeddings_attr": "embed_tokens"},
    "bert": {"layer_attr": "layer", "token_embeddings_attr": "embeddings"},
    "m2m_100": {"layer_attr": "layers", "token_embeddings_attr": "embed_tokens"},
}


def _hf_layer_groups(text, pooler_in_head=True):
    cfg_names = _HF_CONFIG_NAMES[text.config.model_type]
    encoder = text.transformer.encoder if hasattr(text.transformer, "encoder") else text.transformer
    embeddings = getattr(text.transformer, cfg_names["token_embeddings_attr"])
    layer_list = getattr(encoder, cfg_names["layer_attr"])
    pooler = getattr(text.transformer, "pooler", None)
    has_pooler = (pooler is not None) and (next(pooler.parameters(), None) is not None)
    has_proj = not isinstance(text.proj, torch.nn.Identity)

    groups = [("embeddings", [embeddings])]
    groups += [(f"layer.{i}", [layer]) for i, layer in enumerate(layer_list)]
    if has_pooler and not pooler_in_head:
        groups.append(("pooler", [pooler]))
    head = ([pooler] if (has_pooler and pooler_in_head) else []) + ([text.proj] if has_proj else [])
    if head:
        groups.append(("proj", head))
    return groups


def _text_layer_groups(module):
    embed = [
        m for m in (
            getattr(module, "token_embedding", None),
            getattr(module, "positional_embedding", None),
            getattr(module, "cls_emb", None),
        )
        if m is not None
    ]
    groups = []
    if embed:
        groups.append(("embeddings", embed))
    transformer = getattr(module, "transformer", None)
    resblocks = transformer.resblocks if (transformer is not None and hasattr(transformer, "resblocks")) else []
    ln_final = getattr(module, "ln_final", None)
    n = len(resblocks)
    for i, block in enumerate(resblocks):
        layer_members = [block]
        if (i == n - 1) and (ln_final is not None):
            layer_members.append(ln_final)
        groups.append((f"layer.{i}", layer_members))
    text_projection = getattr(module, "text_projection", None)
    if text_projection is not None:
        groups.append(("proj", [text_projection]))
    return groups


def _lr_scales_for_groups(layer_groups, layer_decay):
    n = len(layer_groups)
    return {name: layer_decay ** (n - 1 - idx) for idx, (name, _) in enumerate(layer_groups)}


def _assign_group_scales(groups, layer_decay, param_scale):
    scales = _lr_scales_for_groups(groups, layer_decay)
    for name, members in groups:
        scale = scales[name]
        for member in members:
            params = [member] if isinstance(member, torch.nn.Parameter) else member.parameters()
            for p in params:
                param_scale[id(p)] = scale


def open_clip_main_lr_scales(model: torch.nn.Module, image_decay: Optional[float],
                             text_decay: Optional[float]) -> dict[str, float]:
    """Each parameter's `lr_scale` under OpenCLIP main's layer decay of an OpenCLIP CLIP (its text tower on the
    model, or `model.text`; its image tower a ViT, a ModifiedResNet or a timm trunk): name -> scale, 1.0 outside
    the decayed towers' groups."""
    image_groups = {"VisionTransformer": _vision_layer_groups, "ModifiedResNet": _resnet_layer_groups,
                    "TimmModel": _timm_layer_groups}
    text = getattr(model, "text", model)
    param_scale: dict[int, float] = {}
    if text_decay:
        groups = _hf_layer_groups(text) if type(text).__name__ == "HFTextEncoder" else _text_layer_groups(text)
        _assign_group_scales(groups, text_decay, param_scale)
    if image_decay:
        _assign_group_scales(image_groups[type(model.visual).__name__](model.visual), image_decay, param_scale)
    return {name: param_scale.get(id(p), 1.0) for name, p in model.named_parameters()}
