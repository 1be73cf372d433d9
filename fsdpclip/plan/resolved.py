"""The run's plan: every setting the spec leaves 'auto', settled for one node and world into one object.

`plan_for_node` settles what the spec, the model on the meta device and the node (`Node`) decide before any rank
starts: `validate` shows it, and at start rank 0 builds it for the node the ranks run on (every rank learns it).
What only the ranks can settle stays in `RunPlan.pending`, holding what the node expects, until
`settle_at_start` fills it in: compile 'auto' (a block's work, from FLOPs counted on one rank while another
draws the initial weights), the per-GPU batch searched on the GPUs, and asynchronous saves (sized by the built
model's shards). The trainer records the settled plan in the run directory (`plan.json`); the spec stays what
the user wrote. The rules live beside what they decide (`weights.init_kind`, `units.blocks_per_unit`, the data
source's `plan`, ...); this module is their one caller.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Optional

from torch import nn

from fsdpclip.checkpoint.staging import asynchronous_saves
from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.model.build import Tower, model_config, training_flops_per_sample
from fsdpclip.model.trainable import frozen_meta_model
from fsdpclip.model.weights import init_kind
from fsdpclip.parallel.cuda_graphs import uncapturable_modules
from fsdpclip.parallel.parallelize import COMPILE_MIN_BLOCK_TFLOP, auto_compiles
from fsdpclip.model.units import Layout, blocks_per_unit, whole_tower_wraps
from fsdpclip.plan.batch import search_start
from fsdpclip.plan.memory import GIB
from fsdpclip.plan.mesh import INTER_GBPS, INTRA_GBPS, MemoryModel, Plan, auto_shard_degree, memory_model, \
    resolve_shard_degree, strategies, sustained_tflops
from fsdpclip.run.directory import PLAN_FILE
from fsdpclip.run.files import write_atomically
from fsdpclip.jobspec.job import TOWERS, FsdpSpec, Job


@dataclass(frozen=True)
class Node:
    """What a plan is settled for: the world, the ranks of a node, their device, and what a node has."""

    world_size: int
    gpus_per_node: int
    device: str  # "cuda" or "cpu"
    cores: Optional[int] = None  # usable cores of a node (None: not known here)
    gpu_bytes: Optional[float] = None  # a GPU's memory (None: not known here)


@dataclass(frozen=True)
class RunPlan:
    """Every 'auto' of a job settled for a node and world: concrete values only. `pending` names the fields the
    ranks settle at start (`settle_at_start`); until then they hold what the node expects."""

    world_size: int
    gpus_per_node: int
    device: str  # "cuda" or "cpu"
    shard_degree: int
    per_gpu: int
    grad_accum: int
    init: str  # model.init
    layout: Layout  # fsdp's units, reshard_after_forward and compile
    cuda_graph: bool
    grad_scaler: bool
    async_save: bool
    data: dict[str, Any]  # the data source's settled fields (`DataSource.plan`), e.g. workers, decode
    pending: tuple[str, ...] = ()

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_degree

    @property
    def samples_per_step(self) -> int:
        """The global batch: samples of one optimizer step over all ranks."""
        return self.per_gpu * self.grad_accum * self.world_size

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: dict) -> "RunPlan":
        layout = saved["layout"]
        wrap = {tower: None if classes is None else tuple(classes) for tower, classes in layout["wrap"].items()}
        return cls(**{**saved, "layout": Layout(**{**layout, "wrap": wrap}), "pending": tuple(saved["pending"])})

    def save(self, run_dir: Path) -> None:
        """The plan into the run directory (`plan.json`), beside the spec it settles."""
        write_atomically(Path(run_dir) / PLAN_FILE, json.dumps(self.as_dict(), indent=2) + "\n")


def plan_for_node(job: Job, model: nn.Module, towers: dict[str, Tower], node: Node,
                  flops_per_sample: Optional[float] = None, recorded_batch: Optional[tuple[int, int]] = None,
                  memory: Optional[MemoryModel] = None) -> RunPlan:
    """What the spec, its model (on the meta device, its freeze applied) and `node` settle: everything but the
    `pending` fields. `flops_per_sample` settles compile 'auto' where it weighs a block's work; with per_gpu
    'auto' the batch is `recorded_batch` (per_gpu, grad_accum: an earlier launch's search that still applies),
    else where the search starts (the memory estimate's largest batch for `node.gpu_bytes`; 1 where that is not
    known). Raises `plan.mesh.ShardDegreeError` for a shard degree that does not fit the world."""
    fsdp, world, device = job.fsdp, node.world_size, node.device
    # float8 'auto' stays off until float8 is measured faster on GPUs with a loss curve that holds.
    layout = replace(unit_layout(fsdp, model, towers, device), float8=fsdp.float8 is True)

    @cache
    def measured() -> MemoryModel:
        return memory or memory_model(job, model, towers, layout)[0]

    degree = resolve_shard_degree(fsdp.shard_degree, world, node.gpus_per_node,
                                  lambda: auto_shard_degree(measured(), world, node.gpus_per_node, node.gpu_bytes))
    pending = ["async_save"]
    if fsdp.shard_degree == "auto" and world > node.gpus_per_node and node.gpu_bytes is None and device == "cuda":
        pending.append("shard_degree")
    accum = job.batch.grad_accum
    if job.batch.searched and recorded_batch:
        per_gpu, accum = recorded_batch
    elif job.batch.searched:
        pending += ["per_gpu", "grad_accum"]
        per_gpu = search_start(measured(), job, world, degree, node.gpu_bytes) if node.gpu_bytes else 1
    else:
        per_gpu = job.batch.settled_per_gpu
    ours = auto_compiles(towers, device)
    graphed = fsdp.cuda_graph if fsdp.cuda_graph != "auto" else ours and world == 1 and not (
        fsdp.cpu_offload or fsdp.scales_loss or fsdp.activation_checkpointing.image
        or fsdp.activation_checkpointing.text or uncapturable_modules(model))
    if fsdp.compile == "auto" and not layout.compile and ours:
        if graphed:
            layout = replace(layout, compile=True)
        elif flops_per_sample is None:
            pending.append("compile")
        else:
            layout = replace(layout, compile=_heavy_blocks(towers, per_gpu, flops_per_sample))
    data = DATA_SOURCES[job.data.source].plan(job.data, device, world, node.gpus_per_node, node.cores)
    init = init_kind(job.model, sum(p.numel() for p in model.parameters()))
    return RunPlan(world, node.gpus_per_node, device, degree, per_gpu, accum, init, layout,
                   bool(graphed), fsdp.scales_loss, job.checkpoint.async_save is True and job.checkpoint.periodic,
                   data, tuple(pending))


def settle_at_start(plan: RunPlan, job: Job, towers: dict[str, Tower], *, flops_per_sample: Optional[float] = None,
                    batch: Optional[tuple[int, int]] = None, host_copy_bytes: Optional[int] = None) -> RunPlan:
    """`plan` with its pending fields settled on the ranks: compile 'auto' from `flops_per_sample`, the searched
    `batch` (per_gpu, grad_accum), and checkpoint.async_save from this rank's `host_copy_bytes`
    (`staging.asynchronous_saves`, periodic saves only); each where given."""
    settled, pending = {}, set(plan.pending) - {"shard_degree"}  # the node the ranks run on settled that
    if flops_per_sample is not None and "compile" in pending:
        settled["layout"] = replace(plan.layout, compile=_heavy_blocks(towers, plan.per_gpu, flops_per_sample))
        pending.discard("compile")
    if batch is not None:
        settled["per_gpu"], settled["grad_accum"] = batch
        pending -= {"per_gpu", "grad_accum"}
    if host_copy_bytes is not None:
        settled["async_save"] = job.checkpoint.periodic and asynchronous_saves(
            job.checkpoint.async_save, plan.device, host_copy_bytes, plan.gpus_per_node)
        pending.discard("async_save")
    return replace(plan, **settled, pending=tuple(p for p in plan.pending if p in pending))


def _heavy_blocks(towers: dict[str, Tower], per_gpu: int, flops_per_sample: float) -> bool:
    """Whether a block's forward over a micro batch (the model's FLOPs spread over its blocks; forward is a third
    of training) is work enough to compile (COMPILE_MIN_BLOCK_TFLOP)."""
    blocks = max(1, sum(len(tower.blocks) for tower in towers.values()))
    return flops_per_sample / 3 * per_gpu / blocks >= COMPILE_MIN_BLOCK_TFLOP * 1e12


def unit_layout(fsdp: FsdpSpec, model: nn.Module, towers: dict[str, Tower], device: str) -> Layout:
    """fsdp's units. Where compile 'auto' may compile these towers and each is small enough
    (`units.whole_tower_wraps`), each tower's block container is one unit, compiled whole and kept gathered after
    forward unless the spec says `reshard_after_forward: true`. Else the spec's wrap classes and unit size ('auto':
    `units.blocks_per_unit`), resharded after forward unless the spec says false, compiled where it says so."""
    wraps = whole_tower_wraps(model, towers, fsdp) if fsdp.compile == "auto" and auto_compiles(towers, device) \
        else None
    wrap: dict[str, Optional[tuple[str, ...]]]
    if wraps is not None:
        wrap = {name: tuple(wraps[name]) for name in TOWERS}
        reshard, compiled = fsdp.reshard_after_forward is True, True
    else:
        wrap = {name: None if getattr(fsdp.wrap, name) is None else tuple(getattr(fsdp.wrap, name)) for name in TOWERS}
        reshard, compiled = fsdp.reshard_after_forward is not False, fsdp.compile is True
    sizes = {name: blocks_per_unit(model, towers[name], wrap[name], fsdp.unit_size) for name in TOWERS}
    return Layout(wrap, sizes, reshard, compiled)


def plan_job(job: Job, nodes: int, gpus_per_node: int, gpu_memory_gib: float, tflops: Optional[float] = None,
             intra_gbps: float = INTRA_GBPS, inter_gbps: float = INTER_GBPS) -> Plan:
    """Price every strategy of `fsdpclip plan` for a job that passed `check_job` (its model built on the meta
    device, its freeze applied), with the shard degree its run plan takes on GPUs of `gpu_memory_gib`; `tflops`
    defaults to what fsdpclip sustained for a model of its size."""
    model, towers = frozen_meta_model(model_config(job.model), job)
    memory, _ = memory_model(job, model, towers, unit_layout(job.fsdp, model, towers, "cuda"))
    flops = training_flops_per_sample(model)
    parameters = sum(p.numel() for p in model.parameters())
    rate = tflops or sustained_tflops(parameters)
    world = nodes * gpus_per_node
    auto = job.model_copy(update={"fsdp": job.fsdp.model_copy(update={"shard_degree": "auto"})})
    node = Node(world, gpus_per_node, "cuda", gpu_bytes=gpu_memory_gib * GIB)
    return Plan(nodes, gpus_per_node, parameters, flops, rate, gpu_memory_gib,
                plan_for_node(auto, model, towers, node, flops, memory=memory).shard_degree,
                strategies(job, memory, flops, nodes, gpus_per_node, rate, intra_gbps, inter_gbps))
