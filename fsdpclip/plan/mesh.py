"""The device mesh of a job: which shard degrees (HSDP) are valid, what each costs one GPU (memory,
and bytes moved per step inside its shard group and across replicas), the degree `"auto"` chooses,
and the step-time model of `fsdpclip plan`.

HSDP with shard degree S over W ranks: parameters, gradients and optimizer state are sharded over
the S ranks of a group and replicated over the R = W / S groups; a step all-gathers each unit's
parameters inside the group (in forward, and again in backward when it was resharded),
reduce-scatters its gradients inside the group, then all-reduces the gradient shards across the
R replicas. S = W is plain FSDP, S = 1 replication (DDP-like).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Literal, Optional, Union

from torch import nn

from fsdpclip.model.build import Tower, image_shape, text_shape
from fsdpclip.model.units import Layout, Unit, checkpointed_modules, plan_units
from fsdpclip.plan.memory import DTYPE_BYTES, GIB, MemoryEstimate, activation_elements, estimate_host_memory, \
    estimate_memory, traced_forward
from fsdpclip.jobspec.job import Job

MEMORY_MARGIN = 0.10  # 'auto' keeps this fraction of a GPU's memory free (the estimate is within ~6%)


def shard_degree_problem(degree: int, world: int, gpus_per_node: int) -> Optional[str]:
    """Why a shard degree does not fit the world, or None: it must divide the world size, and a group
    lies inside one node (dividing its ranks) or spans whole nodes."""
    if degree > world or world % degree:
        return f"does not divide the world size {world}"
    if max(degree, gpus_per_node) % min(degree, gpus_per_node):
        return f"a group of {degree} would span part of a node of {gpus_per_node} ranks"
    return None


def valid_shard_degrees(world: int, gpus_per_node: int) -> list[int]:
    """The degrees `shard_degree_problem` accepts, smallest first: among the world's divisors, found up to its
    square root (not by trying every degree up to the world size)."""
    small = [d for d in range(1, math.isqrt(world) + 1) if world % d == 0]
    divisors = sorted({*small, *(world // d for d in small)})
    return [d for d in divisors if shard_degree_problem(d, world, gpus_per_node) is None]


def choose_shard_degree(totals: dict[int, float], capacity: Optional[float], gpus_per_node: int) -> int:
    """'auto': shard inside a node, replicate across nodes. The smallest valid degree of at least one
    node (or the whole world, when smaller) whose estimated peak (bytes, by degree) fits `capacity`
    (bytes) with MEMORY_MARGIN to spare; the largest (full sharding) when none fits or the capacity is
    unknown. Groups smaller than a node save no time there: on 2×H200 replication ran at 0.75–0.81×
    full sharding for ViT-B-32 and equal for ViT-L-14 (docs/benchmarks.md)."""
    smallest = min(gpus_per_node, max(totals))
    if capacity is not None:
        fitting = [d for d, total in sorted(totals.items())
                   if d >= smallest and total <= capacity * (1 - MEMORY_MARGIN)]
        if fitting:
            return fitting[0]
    return max(totals)


def auto_shard_degree(memory: "MemoryModel", world: int, gpus_per_node: int, capacity: Optional[float]) -> int:
    """The degree 'auto' takes for this world and a GPU of `capacity` bytes (None: unknown)."""
    return choose_shard_degree({d: memory.estimate(world, d).total for d in valid_shard_degrees(world, gpus_per_node)},
                               capacity, gpus_per_node)


class ShardDegreeError(ValueError):
    """A shard degree that does not fit the world; the message says why (`shard_degree_problem`)."""


def resolve_shard_degree(chosen: Union[int, Literal["auto"]], world: int, gpus_per_node: int,
                         auto: Callable[[], int]) -> int:
    """The shard degree a job runs with, decided here for `validate` and the trainer alike: `chosen`
    (fsdp.shard_degree) as given, or for 'auto' the whole world when it fits in one node and else
    `auto()` (`auto_shard_degree` with the caller's memory model and GPU capacity, measured only then).
    Raises ShardDegreeError for a given degree that does not fit the world."""
    if chosen == "auto":
        return world if world <= gpus_per_node else auto()
    problem = shard_degree_problem(chosen, world, gpus_per_node)
    if problem:
        raise ShardDegreeError(problem)
    return chosen


@dataclass
class MemoryModel:
    """What the per-GPU memory estimate needs, measured once on the meta device; any degree from it."""

    job: Job
    layout: Layout
    units: list[Unit]
    activations_per_sample: float
    input_bytes_per_sample: float
    feature_width: int

    def estimate(self, world: int, degree: Optional[int] = None) -> MemoryEstimate:
        return estimate_memory(self.job, self.units, self.activations_per_sample, world, self.input_bytes_per_sample,
                               self.feature_width, shard_degree=degree, reshards=self.layout.reshard_after_forward)

    def traffic(self, world: int, degree: int) -> "Traffic":
        """Bytes one GPU moves per step with these units (`traffic`)."""
        return traffic(self.job, self.units, world, degree, self.layout.reshard_after_forward)

    def largest_batch(self, world: int, degree: int, capacity: float, limit: int, grad_accum: int = 1) -> int:
        """The largest per-GPU batch up to `limit` whose estimated peak fits `capacity` bytes (at least 1): where
        `batch.per_gpu: "auto"` starts its search."""
        low, high = 1, limit
        while low < high:
            middle = (low + high + 1) // 2
            fits = replace(self, job=self.job.with_batch(middle, grad_accum)).estimate(world, degree).total <= capacity
            low, high = (middle, high) if fits else (low, middle - 1)
        return low


def memory_model(job: Job, model: nn.Module, towers: dict[str, Tower],
                 layout: Layout) -> tuple[MemoryModel, tuple[int, int]]:
    """The memory model of a built (meta) model with its freeze applied, cut into units as `layout` says (the
    trainer's: `plan.resolved`), and the widths of its image and text features (a forward on the meta device:
    any error of the model's own forward propagates)."""
    units = plan_units(model, towers, layout)
    checkpointed = set(checkpointed_modules(model, towers, job.fsdp))
    sizes, widths = traced_forward(model, [b for tower in towers.values() for b in tower.blocks])
    channels, height, width = image_shape(model)
    input_bytes = channels * height * width * 4 + text_shape(model)[0] * 8  # fp32 pixels, int64 tokens
    return MemoryModel(job, layout, units, activation_elements(model, towers, checkpointed, sizes), input_bytes,
                       widths[0]), widths


@dataclass
class Traffic:
    """Bytes one GPU receives per optimizer step in ring collectives: all-gathers and reduce-scatters
    inside its shard group, all-reduces across the replicas."""

    all_gather: float
    reduce_scatter: float
    all_reduce: float

    @property
    def shard_group(self) -> float:
        return self.all_gather + self.reduce_scatter

    def as_gib(self) -> dict:
        return {"all_gather": round(self.all_gather / GIB, 3), "reduce_scatter": round(self.reduce_scatter / GIB, 3),
                "all_reduce": round(self.all_reduce / GIB, 3)}


def traffic(job: Job, units: list[Unit], world: int, degree: int, reshards: bool) -> Traffic:
    """Per GPU and step: every unit's parameters gathered in forward (and again in backward when
    resharded; the root stays gathered), the trainable gradients reduce-scattered, and their shards
    all-reduced across replicas, once per micro batch; with accumulation every forward runs twice
    (OpenCLIP's accum_freq recomputes each micro batch). A ring moves (n-1)/n of the data per GPU
    for a gather or a scatter, twice that for an all-reduce."""
    fsdp, accum = job.fsdp, job.batch.grad_accum
    param, reduce = DTYPE_BYTES[fsdp.param_dtype], DTYPE_BYTES[fsdp.reduce_dtype]
    inside, replicas = (degree - 1) / degree, world // degree
    forwards = 2 * accum if accum > 1 else 1
    gathered = sum(u.numel * (forwards + (accum if reshards and not u.is_root else 0))
                   for u in units)
    trainable = sum(u.trainable for u in units)
    return Traffic(all_gather=inside * gathered * param, reduce_scatter=inside * accum * trainable * reduce,
                   all_reduce=2 * (replicas - 1) / replicas * accum * trainable / degree * reduce)


# Sustained bf16 rate of one H200 in fsdpclip's own runs (docs/benchmarks.md): ViT-B-32 (151M) at 315 TFLOP/s
# (7,142 samples/s of 44.1 GFLOP at 256/GPU with the default spec, 1×H200, 2026-12-04; the 2-GPU runs of
# 2026-11-29, before CUDA graphs, were host-bound at 103); ViT-L-14, ViT-H-14 and ViT-bigG-14 sustain 314, 283
# and 258 (2026-11-29: MFU × the 781 TFLOP/s matmul peak measured there), here their mean.
MEASURED_TFLOPS = ((300e6, 315.0), (float("inf"), 285.0))
# Bandwidths of the defaults, Gb/s per GPU: NCCL's bus bandwidth on H100/H200 NVLink (~360 GB/s),
# and one 400 Gb/s InfiniBand NDR adapter per GPU at the ~90% NCCL reaches across nodes.
INTRA_GBPS, INTER_GBPS = 2880.0, 360.0
GPU_MEMORY_GIB = 139.0  # what torch reports an H200 holds: plan's GPU when neither flag nor spec names one
EXPOSED_FRACTION = 0.1  # of the communication time, what FSDP cannot overlap (first gather, last reduction)


def sustained_tflops(parameters: int) -> float:
    """The default compute rate of `plan`: what fsdpclip sustained for models of this size."""
    return next(rate for limit, rate in MEASURED_TFLOPS if parameters < limit)


@dataclass
class Strategy:
    """One way to lay a job over the ranks, with what the model of `plan` predicts for it."""

    name: str
    degree: int
    replicas: int
    memory_gib: float
    host_gib_per_node: float  # the first node's (`memory.HostEstimate`)
    traffic: Traffic
    compute_s: float
    communication_s: float
    step_s: float
    samples_per_s_per_gpu: float


def strategy_name(degree: int, world: int) -> str:
    return "replicate (DDP-like)" if degree == 1 else "full FSDP" if degree == world else f"HSDP {degree}"


def strategy(job: Job, memory: MemoryModel, flops_per_sample: float, nodes: int, gpus_per_node: int, degree: int,
             tflops: float, intra_gbps: float = INTRA_GBPS, inter_gbps: float = INTER_GBPS) -> Strategy:
    """Shard degree `degree` over `nodes` × `gpus_per_node`, priced by this model: compute takes samples × FLOPs
    per sample ÷ `tflops`; a collective runs at `intra_gbps` while its group lies in one node and at
    `inter_gbps` once it spans nodes (the shard group when it is larger than a node, the replicas whenever
    there is more than one node). FSDP overlaps its collectives with compute, so a step takes the longer of
    the two plus EXPOSED_FRACTION of the communication."""
    world, samples = nodes * gpus_per_node, job.batch.settled_per_gpu * job.batch.grad_accum
    compute = samples * flops_per_sample / (tflops * 1e12)
    moved = memory.traffic(world, degree)  # the units and resharding as built
    group_gbps = intra_gbps if degree <= gpus_per_node else inter_gbps
    replica_gbps = intra_gbps if nodes == 1 else inter_gbps
    communication = moved.shard_group / (group_gbps * 1e9 / 8) + moved.all_reduce / (replica_gbps * 1e9 / 8)
    step = max(compute, communication) + EXPOSED_FRACTION * communication
    estimate = memory.estimate(world, degree)
    host = estimate_host_memory(estimate, sum(unit.numel for unit in memory.units), gpus_per_node)
    return Strategy(strategy_name(degree, world), degree, world // degree, estimate.total / GIB, host.total / GIB,
                    moved, compute, communication, step, samples / step)


def strategies(job: Job, memory: MemoryModel, flops_per_sample: float, nodes: int, gpus_per_node: int,
               tflops: float, intra_gbps: float = INTRA_GBPS, inter_gbps: float = INTER_GBPS) -> list[Strategy]:
    """Every valid shard degree for `nodes` × `gpus_per_node`, priced by this model (`strategy`)."""
    return [strategy(job, memory, flops_per_sample, nodes, gpus_per_node, degree, tflops, intra_gbps, inter_gbps)
            for degree in valid_shard_degrees(nodes * gpus_per_node, gpus_per_node)]


@dataclass
class Plan:
    """What `fsdpclip plan` shows (`plan.resolved.plan_job`): every strategy for a layout, the inputs of its
    model, and the degree 'auto' takes for GPUs of `gpu_memory_gib`."""

    nodes: int
    gpus_per_node: int
    parameters: int
    flops_per_sample: float
    tflops: float
    gpu_memory_gib: float
    auto_degree: int
    rows: list[Strategy]
