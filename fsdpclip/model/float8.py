"""Float8 matmuls for the linear layers of OpenCLIP's transformer blocks, through torchao's float8 training
(`fsdp.float8`).

`float8_linears` picks the layers by their original names, on any device (the meta device included) and without
torchao: the trainable `nn.Linear`s inside the towers' OpenCLIP blocks (each MLP's `c_fc` and `c_proj`; in a
`CustomResidualAttentionBlock` also its attention's `out_proj`) whose two dims are multiples of 16, as float8 GEMMs
need, and large enough that torchao measured float8 faster for its recipe. Attention's in-projection is a bare
parameter, and `nn.MultiheadAttention`'s out-projection (a subclass of `nn.Linear`) has its weight read directly
wherever the module's own forward runs, which a weight gathered in float8 cannot serve: both stay in param_dtype.
The projection heads, the patch embedding and the logit scale lie outside the blocks; frozen layers keep their
bf16 GEMMs (float8's backward computes a weight gradient they do not need). Other libraries' blocks (timm, Hugging
Face) stay as they are until measured.

`convert_to_float8` swaps those layers for torchao's `Float8Linear` (the same parameters under the same names)
before compile and `fully_shard`. With the tensorwise recipe and a shard group of several ranks
(`gathers_in_float8`), FSDP all-gathers their weights in float8 (half the bytes of bf16), each cast with a scale
agreed over the shard group: inside each all-gather, or for all of them at once after each optimizer step
(`precompute_float8_scales`; not in a CUDA-graphed step, whose graph keeps the scale tensors it captured). On a
CPU (tests), torchao emulates the float8 GEMMs.

Such a weight is a DTensor whose local shard is torchao's wrapper of the plain tensor: checkpoints and the moving
average take the plain tensor (`without_float8_wrappers`), so that a checkpoint loads without torchao.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from fsdpclip.model.build import Tower
from fsdpclip.model.units import Layout
from fsdpclip.jobspec.job import FsdpSpec

FLOAT8_BLOCKS = frozenset({"ResidualAttentionBlock", "CustomResidualAttentionBlock"})
# torch._scaled_mm's float8 GEMMs: Ada (8.9), Hopper (9.0) and later.
FLOAT8_CAPABILITY = (8, 9)
INSTALL_HINT = "pip install 'fsdpclip[float8]'"


def gains_from_float8(out_features: int, in_features: int, recipe: str) -> bool:
    """Whether a linear layer of these dims may run in float8 and gain: dims multiples of 16, and not below the
    sizes where torchao's microbenchmarks on H100 found float8 slower than bf16 for the recipe (its
    `_auto_filter_for_recipe`: the casts cost more than the faster GEMM saves)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return not (k <= 4096 and n <= 1024)
    return not (n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048))


def float8_linears(model: nn.Module, towers: dict[str, Tower], recipe: str) -> list[str]:
    """Names of the layers `fsdp.float8` runs in float8 with `recipe` (see the module's docstring), in model order."""
    blocks = [block for tower in towers.values() for block in tower.blocks
              if type(model.get_submodule(block)).__name__ in FLOAT8_BLOCKS]
    return [f"{block}.{name}" for block in blocks for name, module in model.get_submodule(block).named_modules()
            if type(module) is nn.Linear and module.weight.requires_grad
            and gains_from_float8(module.out_features, module.in_features, recipe)]


def gathers_in_float8(fsdp: FsdpSpec, layout: Layout, mesh: DeviceMesh) -> bool:
    """Whether FSDP all-gathers the float8 layers' weights in float8: with tensorwise scaling (one scale per
    weight), over a shard group of several ranks (one rank gathers nothing), without CPU offload."""
    return layout.float8 and fsdp.float8_recipe == "tensorwise" and mesh.size(mesh.ndim - 1) > 1 \
        and not fsdp.cpu_offload


def convert_to_float8(model: nn.Module, names: list[str], recipe: str, gather_in_float8: bool,
                      emulate: bool) -> None:
    """Swap the layers `names` of `model` for torchao's Float8Linear with `recipe` (in place, any device, meta
    included); with `gather_in_float8`, FSDP all-gathers their weights in float8; `emulate`: GEMMs in float32 on
    float8 values, for devices without float8 GEMMs (tests)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                                 enable_fsdp_float8_all_gather=gather_in_float8)
    chosen = set(names)
    convert_to_float8_training(model, module_filter_fn=lambda module, name: name in chosen, config=config)


def precompute_float8_scales(model: nn.Module) -> None:
    """The float8 scale of every weight FSDP gathers in float8, from its new values after an optimizer step: one
    all-reduce for all of them, instead of one per weight inside each all-gather."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def _weight_wrapper() -> Optional[type]:
    """torchao's class of the weights FSDP gathers in float8, where torchao is loaded (else no weight is one)."""
    module = sys.modules.get("torchao.float8.fsdp_utils")
    return getattr(module, "WeightWithDynamicFloat8CastTensor", None) if module is not None else None


def without_float8_wrapper(tensor: Any) -> Any:
    """`tensor` as the plain tensor it wraps, the same storage (a DTensor keeps its mesh and placements), where it
    is a weight gathered in float8; anything else as it is."""
    wrapper = _weight_wrapper()
    if wrapper is None:
        return tensor
    if isinstance(tensor, DTensor) and isinstance(tensor._local_tensor, wrapper):
        plain = tensor._local_tensor.__dict__["_tensor"].detach()
        return DTensor.from_local(plain, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape,
                                  stride=tensor.stride())
    return tensor.__dict__["_tensor"].detach() if isinstance(tensor, wrapper) else tensor


def without_float8_wrappers(state: Any) -> Any:
    """A (nested) state dict with `without_float8_wrapper` applied to every tensor in it."""
    return tree_map(without_float8_wrapper, state)


def forget_float8_scales(model: nn.Module) -> None:
    """Drop the precomputed float8 scales of `model`'s weights (after their values were replaced, as an evaluation
    of the moving average does): the next all-gathers compute them from the values as they are."""
    wrapper = _weight_wrapper()
    if wrapper is None:
        return
    for parameter in model.parameters():
        shard = parameter._local_tensor if isinstance(parameter, DTensor) else parameter
        if isinstance(shard, wrapper):
            shard._precomputed_scale = None  # pyright: ignore[reportAttributeAccessIssue]  (torchao's attribute)


def float8_problem(device: torch.device) -> Optional[str]:
    """Why this process cannot train in float8 on `device` (None: it can): no torchao, or no float8 GEMMs there."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return f"needs the 'torchao' package: {INSTALL_HINT}"
    if device.type != "cuda":
        return f"float8 GEMMs need a CUDA GPU; this rank's device is the {device.type.upper()}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return capability_problem(torch.cuda.get_device_name(device), capability)
    return None


def capability_problem(gpu: str, capability: tuple[int, int]) -> str:
    """Why a GPU of this compute capability cannot run float8 GEMMs."""
    return (f"float8 GEMMs need compute capability {'.'.join(map(str, FLOAT8_CAPABILITY))} or later (Ada, Hopper); "
            f"{gpu} has {capability[0]}.{capability[1]}")
