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

from fsdpclip.model import Tower, instances, tower_of
from fsdpclip.spec import TOWERS, FsdpSpec


# 'auto' unit size: per-unit overhead is fixed, so large units amortise it. On 2×H200 the
# fastest units were whole towers for ViT-B-32/ViT-L-14 and ~400M parameters for ViT-bigG-14
# (docs/performance.md); two gathered units of that size in bf16 take ~2 GiB.
AUTO_UNIT_PARAMETERS = 400_000_000


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


def wrap_classes(fsdp: FsdpSpec, tower: Tower) -> list[str]:
    """The classes of `tower` that become units (default: its blocks)."""
    chosen = getattr(fsdp.wrap, tower.name)
    return list(tower.block_classes) if chosen is None else chosen


def checkpointed_modules(model: nn.Module, towers: dict[str, Tower], fsdp: FsdpSpec) -> list[str]:
    """Names of the modules whose activations are recomputed: the outermost instances of each
    tower's configured classes (true: its block classes)."""
    names = []
    for tower in towers.values():
        chosen = getattr(fsdp.activation_checkpointing, tower.name)
        classes = list(tower.block_classes) if chosen is True else (chosen or [])
        names += instances(model.named_modules(), tower.name, classes)
    return names


def blocks_per_unit(model: nn.Module, first_block: str, unit_size) -> int:
    """`unit_size`, with 'auto' resolved to about AUTO_UNIT_PARAMETERS per unit."""
    if unit_size != "auto":
        return unit_size
    block = sum(p.numel() for p in model.get_submodule(first_block).parameters())
    return max(1, round(AUTO_UNIT_PARAMETERS / max(1, block)))


def plan_units(model: nn.Module, towers: dict[str, Tower], fsdp: FsdpSpec) -> list[Unit]:
    """Units in the order fully_shard must see them: innermost first, the root last.

    With more than one block per unit, consecutive outermost wrap-class modules of a tower
    share one unit; with one, every wrap-class module (nested ones too) is its own unit.
    """
    groups: list[tuple[tuple[str, ...], str]] = []  # (module names, tower)
    for tower_name in TOWERS:
        classes = set(wrap_classes(fsdp, towers[tower_name]))
        outer = instances(model.named_modules(), tower_name, classes)
        size = blocks_per_unit(model, outer[0], fsdp.unit_size) if outer else 1
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


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORWARD_METHODS = ("encode_image", "encode_text")


def apply_activation_checkpointing(model: nn.Module, names: list[str]) -> None:
    """Recompute the activations of these modules in backward; parameter names are kept."""
    from torch.distributed._composable import checkpoint

    for name in names:
        checkpoint(model.get_submodule(name))


def apply_compile(model: nn.Module, units: list[Unit]) -> None:
    """torch.compile the forward of every unit below the root; FSDP's hooks stay eager around it."""
    for unit in units[:-1]:
        for name in unit.modules:
            module = model.get_submodule(name)
            module.forward = torch.compile(module.forward)


def apply_fsdp(model: nn.Module, units: list[Unit], fsdp: FsdpSpec, mesh, device: torch.device) -> None:
    """fully_shard every unit, innermost first, then the root (whose outputs come back in fp32)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
    )

    param_dtype, reduce_dtype = DTYPES[fsdp.param_dtype], DTYPES[fsdp.reduce_dtype]
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    for unit in units:
        modules = [model.get_submodule(name) if name else model for name in unit.modules]
        if not unit.is_root:
            for module in modules:
                cast_constants(module, param_dtype)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                      output_dtype=torch.float32 if unit.is_root else None)
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=fsdp.reshard_after_forward, mp_policy=policy, offload_policy=offload)
    register_forward_methods(model)


def cast_constants(module: nn.Module, dtype: torch.dtype) -> None:
    """Give a block's non-persistent floating buffers the compute dtype. FSDP's mixed precision casts
    parameters only, and such constants meet them in the block's arithmetic (EVA's zero k_bias is
    concatenated with the q/v biases, Swin adds its attention mask); in fp32 they fail a bf16
    forward. Persistent buffers (BatchNorm statistics) keep their dtype."""
    for sub in module.modules():
        for key, buffer in sub._buffers.items():
            if buffer is not None and buffer.is_floating_point() and key in sub._non_persistent_buffers_set:
                sub._buffers[key] = buffer.to(dtype)


def register_forward_methods(model: nn.Module) -> None:
    """Make `encode_image`/`encode_text` callable on their own (FSDP gathers the root around them).

    OpenCLIP's forward calls them too; inside the root's forward they must run plainly, or the
    nested call would reshard the root before forward reads `logit_scale`.
    """
    from torch.distributed.fsdp import register_fsdp_forward_method

    depth = [0]
    model.register_forward_pre_hook(lambda module, args: depth.__setitem__(0, depth[0] + 1))
    model.register_forward_hook(lambda module, args, out: depth.__setitem__(0, depth[0] - 1), always_call=True)
    for name in FORWARD_METHODS:
        plain = getattr(model, name)
        register_fsdp_forward_method(model, name)
        hooked = getattr(model, name)

        def method(*args, _plain=plain, _hooked=hooked, **kwargs):
            return (_plain if depth[0] else _hooked)(*args, **kwargs)

        setattr(model, name, method)


def materialize(model: nn.Module, device: torch.device, offload: bool, source: Optional[nn.Module]) -> None:
    """Give the sharded meta model real storage and the weights of `source` (a full model on rank 0).

    Rank 0 broadcasts each tensor in turn; every rank copies out only its own rows (FSDP2 shards
    dim 0 in chunks of ceil(n / world)), so the work per rank does not grow with the world size.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    model.to_empty(device="cpu" if offload else device)
    if offload:
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    originals = dict(source.named_parameters()) | dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            full = originals[name].to(device, tensor.dtype) if source is not None else \
                torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dist.broadcast(full, src=0)
            if isinstance(tensor, DTensor):
                shard = tensor.to_local()
                rows = -(-full.shape[0] // world) if full.dim() else 1
                start = min(rank * rows, full.shape[0] if full.dim() else 0)
                shard.copy_(full.narrow(0, start, shard.shape[0]) if full.dim() else full)
            else:
                tensor.copy_(full)
