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


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORWARD_METHODS = ("encode_image", "encode_text")


def apply_activation_checkpointing(model: nn.Module, classes: dict[str, list[str]]) -> list[str]:
    """Recompute the activations of these classes (per tower) in backward; names are kept."""
    from torch.distributed._composable import checkpoint

    from fsdpclip.model import instances

    chosen = [name for tower, names in classes.items() for name in instances(model.named_modules(), tower, names)]
    for name in chosen:
        checkpoint(model.get_submodule(name))
    return chosen


def apply_compile(model: nn.Module, units: list[Unit]) -> None:
    """torch.compile the forward of every unit below the root; FSDP's hooks stay eager around it."""
    for unit in units[:-1]:
        module = model.get_submodule(unit.module)
        module.forward = torch.compile(module.forward)


def apply_fsdp(model: nn.Module, units: list[Unit], fsdp: FsdpSpec, mesh, device: torch.device) -> None:
    """fully_shard every unit, innermost first, then the root (whose outputs come back in fp32)."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
    )

    param_dtype, reduce_dtype = DTYPES[fsdp.param_dtype], DTYPES[fsdp.reduce_dtype]
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    for unit in units:
        module = model.get_submodule(unit.module) if unit.module else model
        is_root = module is model
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                      output_dtype=torch.float32 if is_root else None)
        fully_shard(module, mesh=mesh, reshard_after_forward=fsdp.reshard_after_forward, mp_policy=policy,
                    offload_policy=offload)
    register_forward_methods(model)


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

    Rank 0 streams each tensor to the others, which keep only their shards; buffers that are
    not in the state dict (attention masks) are broadcast as they are.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device="cpu" if offload else device)
    if offload:
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
    full = source.state_dict() if source is not None else {}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name not in persistent:
            if source is not None:
                buffer.copy_(source.get_buffer(name))
            dist.broadcast(buffer, src=0)
