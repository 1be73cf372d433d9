"""Turn a built model into the sharded one, and give the sharded model its weights.

`parallelize` is the one place that applies the plan of `fsdpclip.model.units`, in torchtitan's order:
float8 layers (`fsdpclip.model.float8`), activation checkpointing, then per-unit compile, then `fully_shard`
on every unit innermost first and the root last. The trainer, evaluation and the benchmarks all go through it.
`materialize` then gives the meta-device result real storage and rank 0's weights.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdpclip.model.build import SHARED_PARAMETERS, find_towers
from fsdpclip.model.fast_modules import use_direct_attention, use_direct_patch_embedding
from fsdpclip.model.float8 import convert_to_float8, float8_linears, gathers_in_float8
from fsdpclip.model.units import Layout, Unit, checkpointed_modules, plan_units
from fsdpclip.run.files import write_atomically
from fsdpclip.jobspec.job import FsdpSpec

log = logging.getLogger("fsdpclip")


def parallelize(model: nn.Module, fsdp: FsdpSpec, layout: Layout, mesh: DeviceMesh,
                block_classes: Optional[dict[str, Optional[list[str]]]] = None) -> nn.Module:
    """Apply float8 layers, activation checkpointing, compile and FSDP2 to `model` (on the meta device) as `fsdp`
    asks, with its units, resharding, compile and float8 as `layout` settles them (`plan.resolved`), sharding over
    `mesh`; returns it. Parameter names stay the original ones."""
    towers = find_towers(model, block_classes)
    checkpointed, units = checkpointed_modules(model, towers, fsdp), plan_units(model, towers, layout)
    if fsdp.direct_attention:  # after the plan: it names classes as validation saw them (Conv2d, MultiheadAttention)
        use_direct_attention(model)
    if fsdp.direct_patch_embedding:
        use_direct_patch_embedding(model)
    options = fsdp.compile_options
    if layout.float8:
        names = float8_linears(model, towers, fsdp.float8_recipe)
        convert_to_float8(model, names, fsdp.float8_recipe, gathers_in_float8(fsdp, layout, mesh),
                          emulate=mesh.device_type != "cuda")
        log.info("fsdp.float8 (%s): %d linear layers in float8; MFU stays counted against the bf16 peak "
                 "(bf16-equivalent)", fsdp.float8_recipe, len(names))
        if names and fsdp.float8_recipe == "rowwise":  # torchtitan's: compiled casts round as eager's (pytorch#150859)
            options = {"emulate_precision_casts": True, **options}
    apply_activation_checkpointing(model, checkpointed)
    if layout.compile:
        apply_compile(model, units, options)
    apply_fsdp(model, units, fsdp, layout.reshard_after_forward, mesh)
    return model


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FORWARD_METHODS = ("encode_image", "encode_text")


def apply_activation_checkpointing(model: nn.Module, names: list[str]) -> None:
    """Recompute the activations of these modules in backward; parameter names are kept."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    for name in names:
        checkpoint(model.get_submodule(name))


# A compiled block saves device time but costs host time per call (guards, the autograd wrapper), so it
# pays only where a block's forward keeps the GPU busy for longer. Measured on H200 (docs/performance.md,
# single runs): TFLOP per block forward over a micro batch -> compiled vs eager: ViT-B-32 at 256/GPU
# 0.16 -> 0.90x, ViT-H-14 at 64/GPU 0.44 -> 0.77x, ViT-L-14 at 128/GPU 0.62 -> 1.10x (1.18x in an earlier run);
# ViT-bigG-14 at 32/GPU 0.43 -> 0.80x on 2 GPUs (1.06x on 1 GPU, where gathers are copies; 2026-12-01).
# Whole towers compiled as one graph beat both where a tower is small enough.
COMPILE_MIN_BLOCK_TFLOP = 0.5
# The blocks that rule was measured on: OpenCLIP's own. Other towers' blocks (timm, Hugging Face) stay eager
# under 'auto' until measured beside eager: the one compiled run of such towers (the 10B example, EVA02-E-14
# + mT5-XXL, 2×H200) trained normally at 41.3 samples/s/GPU, with no eager run of the same code beside it.
COMPILE_AUTO_BLOCKS = frozenset({"ResidualAttentionBlock", "CustomResidualAttentionBlock"})


def auto_compiles(towers: dict, device_type: str) -> bool:
    """Whether compile 'auto' may compile these towers at all: on CUDA, OpenCLIP's own blocks only."""
    return device_type == "cuda" and {c for t in towers.values() for c in t.block_classes} <= COMPILE_AUTO_BLOCKS


def apply_compile(model: nn.Module, units: list[Unit], options: Optional[dict] = None) -> None:
    """torch.compile the forward of every module of the units below the root (blocks, or a tower's
    block container), as torchtitan does for blocks, with inductor `options` (`fsdp.compile_options`);
    FSDP's hooks stay eager around it. Shapes are static: the text and image blocks share one `forward`,
    and automatic dynamic shapes would turn the second shape seen into a slower dynamic kernel. Evaluation
    (other batch shapes, run rarely) calls the eager forward, so it neither recompiles nor meets the limit."""
    for unit in units[:-1]:
        for name in unit.modules:
            module = model.get_submodule(name)
            # a copy per call: torch.compile takes some keys out of the dict it is given
            compiled = torch.compile(module.forward, dynamic=False, options=dict(options) if options else None)
            module.forward = functools.partial(_train_compiled, module, module.forward, compiled)


# torch.compile's caches live on the machine (TORCHINDUCTOR_CACHE_DIR, /tmp by default): a job requeued
# on other nodes compiles again from nothing. Rank 0 keeps the artifacts of its first compiled step in the
# run directory; every rank of a later launch loads them first. Only a cache: one that cannot be used
# (another torch, a damaged file, a torch without these functions, < 2.7) is passed over.
COMPILE_CACHE = "compile-cache.bin"


def load_compile_cache(path: Path) -> int:
    """Load compile artifacts saved by `save_compile_cache` into this process's caches; how many."""
    if not path.is_file() or not hasattr(torch.compiler, "load_cache_artifacts"):
        return 0
    try:
        return _artifacts(torch.compiler.load_cache_artifacts(path.read_bytes()))
    except Exception as exc:  # noqa: BLE001  (whatever a foreign or damaged cache raises)
        log.warning("compile cache %s not used: %s", path, exc)
        return 0


def save_compile_cache(path: Path) -> int:
    """Write the artifacts this process compiled so far to `path` (whole or not at all); how many."""
    if not hasattr(torch.compiler, "save_cache_artifacts"):
        return 0
    try:
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return 0
        content, info = saved
        write_atomically(path, content)
        return _artifacts(info)
    except Exception as exc:  # noqa: BLE001  (a cache never stops the run)
        log.warning("compile cache not kept in %s: %s", path, exc)
        return 0


def _artifacts(info) -> int:
    """How many artifacts a torch.compiler CacheInfo lists (torch 2.7: one list per kind; 2.8 on: a dict)."""
    if info is None:
        return 0
    lists = getattr(info, "artifacts", None) or {k: v for k, v in vars(info).items() if k.endswith("_artifacts")}
    return sum(len(keys) for keys in lists.values())


def _train_compiled(module: nn.Module, eager, compiled, *args, **kwargs):
    return (compiled if module.training else eager)(*args, **kwargs)


def apply_fsdp(model: nn.Module, units: list[Unit], fsdp: FsdpSpec, reshard_after_forward: bool,
               mesh: DeviceMesh) -> None:
    """fully_shard every unit, innermost first, then the root (whose outputs come back in fp32).

    The learned temperature and bias stay out of the root unit: replicated fp32 parameters on
    every rank (FSDP's mixed precision would compute exp(logit_scale) in bf16, ~1% steps; OpenCLIP
    under autocast keeps them fp32), their gradients averaged by `average_replicated_gradients`.
    They are taken off the root while it is sharded (what torch >= 2.7 calls ignored_params).
    """
    from torch.distributed.fsdp import (
        CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard,
    )

    param_dtype, reduce_dtype = DTYPES[fsdp.param_dtype], DTYPES[fsdp.reduce_dtype]
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if fsdp.cpu_offload else OffloadPolicy()
    for unit in units:
        modules = [model.get_submodule(name) if name else model for name in unit.modules]
        if not unit.is_root:
            for module in modules:
                cast_constants(module, param_dtype)
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                                      output_dtype=torch.float32 if unit.is_root else None)
        kept = {name: model._parameters.pop(name) for name in SHARED_PARAMETERS
                if unit.is_root and model._parameters.get(name) is not None}
        fully_shard(modules if len(modules) > 1 else modules[0], mesh=mesh,
                    reshard_after_forward=reshard_after_forward, mp_policy=policy, offload_policy=offload)
        for name, parameter in kept.items():
            model.register_parameter(name, parameter)
    register_forward_methods(model)


def reshard(model: nn.Module) -> None:
    """Free the gathered parameters a forward without backward left behind (evaluation: FSDP reshards
    after backward, and units kept gathered after forward stay so); the module holds its shards again,
    as the optimizer and checkpoints know them. A model without FSDP is left as it is."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def replicated_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters every rank holds whole (the temperature and bias), not FSDP's DTensor shards."""
    from torch.distributed.tensor import DTensor

    return [p for p in model.parameters() if not isinstance(p, DTensor)]


def average_replicated_gradients(replicated: list[nn.Parameter]) -> None:
    """Average the gradients of the replicated parameters (`replicated_parameters`) over all ranks, as
    FSDP's reduce-scatter averages the others (one small all-reduce per step)."""
    import torch.distributed as dist

    grads = [p.grad for p in replicated if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()
    for grad, part in zip(grads, flat.split([g.numel() for g in grads])):
        grad.copy_(part.view_as(grad))


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
    dim 0 in chunks of ceil(n / group size) over the mesh's shard group; HSDP replicas hold the same
    rows), so the work per rank does not grow with the world size.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from fsdpclip.parallel.distributed import shard_coordinate

    model.to_empty(device="cpu" if offload else device)
    if offload:  # only FSDP's shards live on the host; buffers and replicated parameters stay on the device
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
            for key, param in module._parameters.items():
                if param is not None and not isinstance(param, DTensor):
                    module._parameters[key] = nn.Parameter(param.to(device), requires_grad=param.requires_grad)
    originals = dict(source.named_parameters()) | dict(source.named_buffers()) if source is not None else {}
    with torch.no_grad():
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            full = originals[name].to(device, tensor.dtype) if source is not None else \
                torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
            dist.broadcast(full, src=0)
            if isinstance(tensor, DTensor):
                shard = tensor.to_local()
                index, size = shard_coordinate(tensor.device_mesh)
                rows = -(-full.shape[0] // size) if full.dim() else 1
                start = min(index * rows, full.shape[0] if full.dim() else 0)
                shard.copy_(full.narrow(0, start, shard.shape[0]) if full.dim() else full)
            else:
                tensor.copy_(full)
