"""Per-GPU memory estimate of a job, computed on the meta device before anything is allocated."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch
from torch import nn

from fsdpclip.model.build import Tower, fake_batch
from fsdpclip.model.units import Unit
from fsdpclip.jobspec.job import Job

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# Activations a transformer block keeps for backward, in elements per element of its output
# (Korthikanti et al. 2022, 34·s·h bytes at 16 bits, with fused attention and no dropout).
BLOCK_ACTIVATION_FACTOR = 17
GIB = 1024 ** 3
# A rank's process on the host besides any state it holds: torch, the CUDA context, OpenCLIP, its buffers.
RANK_PROCESS_BYTES = 2 * GIB


@dataclass
class MemoryEstimate:
    """Bytes per GPU: the sharded state, the unsharded working copies and the activations."""

    world_size: int
    shard_degree: int  # ranks the state is sharded over (the world size, or an HSDP group)
    parameters: float  # fp32 master shards
    gradients: float  # fp32 gradient shards (trainable only)
    optimizer: float  # AdamW moments (trainable only)
    ema: float  # the `ema` block's fp32 averages of the trainable shards
    unsharded: float  # gathered parameters and gradients of the units in flight
    activations: float  # kept for backward (a rough figure), and the contrastive logits
    inputs: float  # the step's micro batches on the device, and the features cached for accumulation
    host: float  # sharded state held in CPU memory when offloaded
    staging: float  # in CPU memory: the host copy of asynchronous saves (checkpoint.async_save true)

    @property
    def total(self) -> float:
        """The peak: gradients are freed each step, so they grow in backward as activations are
        released; the peak is at the turn from forward to backward (or at the end of backward)."""
        return self.parameters + self.optimizer + self.ema + self.unsharded + self.inputs + \
            max(self.activations, self.gradients)

    def as_gib(self) -> dict:
        out = {k: round(v / GIB, 3) for k, v in asdict(self).items() if k not in ("world_size", "shard_degree")}
        out["total"] = round(self.total / GIB, 3)
        out["world_size"], out["shard_degree"] = self.world_size, self.shard_degree
        return out


@dataclass
class HostEstimate:
    """Bytes of host memory one node needs: its ranks' processes, the state they hold there with CPU
    offload, the host copies of asynchronous saves, and the whole fp32 model the first rank builds its initial
    weights in before they are sharded."""

    ranks: int
    processes: float
    offloaded_state: float
    checkpoint_staging: float
    initial_weights: float

    PARTS = ("processes", "offloaded_state", "checkpoint_staging", "initial_weights")

    @property
    def total(self) -> float:
        return sum(getattr(self, part) for part in self.PARTS)

    def as_gib(self) -> dict:
        out = {k: round(getattr(self, k) / GIB, 3) for k in self.PARTS}
        return {"ranks": self.ranks, **out, "total": round(self.total / GIB, 3)}


def host_parts(gib: dict) -> str:
    """A host estimate as `HostEstimate.as_gib` gives it, in words: its total and its parts."""
    staged = f", checkpoint staging {gib['checkpoint_staging']:.1f}" if gib["checkpoint_staging"] else ""
    return (f"{gib['total']:.1f} GiB ({gib['ranks']} rank processes {gib['processes']:.1f}, offloaded state "
            f"{gib['offloaded_state']:.1f}{staged}, initial weights {gib['initial_weights']:.1f})")


def estimate_host_memory(estimate: MemoryEstimate, parameters: int, ranks_per_node: int) -> HostEstimate:
    """The host memory of the node with the first rank (the one that needs most), from the per-GPU
    `estimate` (its `host` part is a rank's offloaded state, its `staging` a rank's host copy) and the model's
    parameter count."""
    return HostEstimate(ranks_per_node, ranks_per_node * RANK_PROCESS_BYTES, ranks_per_node * estimate.host,
                        ranks_per_node * estimate.staging, 4.0 * parameters)


def traced_forward(model: nn.Module, blocks: list[str]) -> tuple[dict[str, int], tuple[int, int]]:
    """One forward on the meta device: the output elements per sample of each block, and the
    widths of the image and text features."""
    sizes: dict[str, int] = {}

    def record(name):
        def hook(module, args, output):
            first = output[0] if isinstance(output, (tuple, list)) else output
            sizes[name] = first.numel() // 2
        return hook

    handles = [model.get_submodule(name).register_forward_hook(record(name)) for name in blocks]
    try:
        with fake_batch(model) as (images, texts), torch.no_grad():
            image_features, text_features = model(images, texts)[:2]
    finally:
        for handle in handles:
            handle.remove()
    return sizes, (image_features.shape[-1], text_features.shape[-1])


def activation_elements(model: nn.Module, towers: dict[str, Tower], checkpointed: set[str],
                        sizes: dict[str, int]) -> float:
    """Activation elements one sample keeps for backward, from the block output sizes of `traced_forward`.

    A block keeps BLOCK_ACTIVATION_FACTOR times its output, a checkpointed block only its input,
    and a block before the first trainable parameter of its tower nothing at all.
    """
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    elements = 0.0
    for tower in towers.values():
        grad_flows = any(n in trainable for n in tower.parameters if tower.part_of(n) == "embeddings")
        for index, name in enumerate(tower.blocks):
            grad_flows = grad_flows or any(n in trainable for n in tower.parameters if tower.block_of(n) == index)
            if not grad_flows:
                continue
            inside_checkpoint = any(name == c or name.startswith(c + ".") for c in checkpointed)
            elements += sizes[name] if inside_checkpoint else BLOCK_ACTIVATION_FACTOR * sizes[name]
    return elements


def estimate_memory(job: Job, units: list[Unit], activations_per_sample: float, world_size: int,
                    input_bytes_per_sample: float = 0.0, feature_width: int = 0,
                    shard_degree: Optional[int] = None, reshards: bool = True) -> MemoryEstimate:
    """Peak memory of one GPU for `job` at `world_size`, its state sharded over `shard_degree` ranks
    (default: all of them), its units resharded after forward where `reshards`; the activation part from
    `activation_elements`.

    Gradient accumulation (OpenCLIP's accum_freq) keeps activations at one micro batch's, but holds
    all the step's micro batches on the device, caches their image and text features, and each micro
    batch's logits span the whole global batch.
    """
    fsdp, micro, accum = job.fsdp, job.batch.settled_per_gpu, job.batch.grad_accum
    param_bytes, reduce_bytes = DTYPE_BYTES[fsdp.param_dtype], DTYPE_BYTES[fsdp.reduce_dtype]
    degree = shard_degree or world_size
    params = sum(u.shard_numel(degree) for u in units) * 4
    trainable_fraction = [u.trainable / u.numel if u.numel else 0.0 for u in units]
    grads = sum(u.shard_numel(degree) * f for u, f in zip(units, trainable_fraction)) * 4
    optimizer = 2 * grads
    ema = grads if job.moving_average is not None else 0.0
    # A periodic save's host copy holds the rank's state (fp32 shards, moments, averages); 'auto' takes one only
    # where a node's fit in a quarter of its memory (checkpoint.staging.asynchronous_saves).
    staging = params + optimizer + ema if job.checkpoint.async_save is True and job.checkpoint.periodic else 0.0
    root, blocks = units[-1], units[:-1]
    largest = max((u.numel for u in blocks), default=0)
    gathered_blocks = sum(u.numel for u in blocks) if not reshards else 2 * largest
    unsharded = (root.numel + gathered_blocks) * param_bytes + max(largest, root.numel) * (param_bytes + reduce_bytes)
    logits = 3 * micro * micro * accum * world_size * 4
    activations = activations_per_sample * micro * param_bytes + logits
    inputs = micro * accum * input_bytes_per_sample + (2 * micro * accum * feature_width * 4 if accum > 1 else 0)
    host = 0.0
    if fsdp.cpu_offload:
        host, params, grads, optimizer, ema = params + grads + optimizer + ema, 0.0, 0.0, 0.0, 0.0
    return MemoryEstimate(world_size, degree, params, grads, optimizer, ema, unsharded, activations, inputs, host,
                          staging)
