"""The trainer's model set-up: the run plan (`plan_run`), then the sharded model with its initial weights
(`build_model`: a `BuiltModel`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from fsdpclip.model.build import OpenClip, training_flops_per_sample
from fsdpclip.model.trainable import DecayGroup, trainable_decay_groups
from fsdpclip.model.weights import initial_model
from fsdpclip.run.node import cores_per_local_rank, usable_cores
from fsdpclip.parallel.distributed import Dist, shard_mesh
from fsdpclip.model.float8 import float8_problem, gathers_in_float8
from fsdpclip.parallel.parallelize import COMPILE_CACHE, load_compile_cache, materialize, parallelize, \
    save_compile_cache
from fsdpclip.plan.memory import GIB
from fsdpclip.plan.mesh import ShardDegreeError
from fsdpclip.plan.resolved import Node, RunPlan, plan_for_node, settle_at_start
from fsdpclip.run.directory import EXIT_SPEC
from fsdpclip.run.lock import StartupClock
from fsdpclip.jobspec.job import Job
from fsdpclip.train.stops import Stop

log = logging.getLogger("fsdpclip")


@dataclass(frozen=True)
class BuiltModel:
    """The sharded model with its initial weights, and what building it settled: the decay groups (taken on the
    original names), the training FLOPs per sample, the run plan with compile 'auto' decided from them, and whether
    the float8 layers' weights are gathered in float8 (`float8_scales`: their scales precomputed after each step)."""

    model: OpenClip
    decay_groups: list[DecayGroup]
    flops_per_sample: float
    plan: RunPlan
    float8_scales: bool


def plan_run(job: Job, env: Dist, model: torch.nn.Module, towers,
             recorded_batch: Callable[[], Optional[tuple[int, int]]]) -> RunPlan:
    """The run plan for this node (`plan.resolved.plan_for_node`), built by rank 0 and given to every rank: a
    GPU's memory is launch.gpu_memory_gib, else the device's; per_gpu 'auto' takes `recorded_batch()` (an earlier
    launch's record where it applies: train.sizing), asked on rank 0 only."""
    if job.fsdp.cuda_graph is True and env.device.type != "cuda":
        raise Stop(EXIT_SPEC, "fsdp.cuda_graph true needs CUDA devices")
    if job.batch.searched and env.device.type != "cuda":
        raise Stop(EXIT_SPEC, "batch.per_gpu 'auto' probes steps on the GPU; this run's device is the CPU")
    decided: list[Any] = [None]  # rank 0's plan, or why there is none
    if env.is_main:
        gpu_bytes = job.launch.gpu_memory_gib * GIB if job.launch.gpu_memory_gib else \
            torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else None
        node = Node(env.world_size, env.local_world_size, env.device.type, usable_cores(), gpu_bytes)
        try:
            decided[0] = plan_for_node(job, model, towers, node, recorded_batch=recorded_batch())
        except ShardDegreeError as exc:
            decided[0] = f"fsdp.shard_degree {job.fsdp.shard_degree}: {exc}"
    dist.broadcast_object_list(decided, src=0)
    if isinstance(decided[0], str):
        raise Stop(EXIT_SPEC, decided[0])
    if decided[0].layout.float8 and (problem := float8_problem(env.device)):
        raise Stop(EXIT_SPEC, f"fsdp.float8 true: {problem}")
    return decided[0]


def build_model(job: Job, env: Dist, plan: RunPlan, model: torch.nn.Module, towers,
                startup: StartupClock) -> BuiltModel:
    """The sharded model with its initial weights, from the frozen meta-device `model` every rank built (sharded in
    place): decay groups and FLOPs taken on the original names (which settle compile 'auto'), parallelized as the
    plan lays it out, then filled from rank 0. The last rank counts the FLOPs while rank 0 draws the initial
    weights."""
    decay_groups = trainable_decay_groups(model, job.optimizer)
    mesh = shard_mesh(env, plan.shard_degree)
    if env.is_main:
        log.info("mesh: %d replica(s) × shard groups of %d", plan.replicas, plan.shard_degree)
    flops_rank = env.world_size - 1
    flops: list = [training_flops_per_sample(model) if env.rank == flops_rank else None]
    source = None
    if env.is_main:
        began = time.perf_counter()
        source = initial_model(job.model, job.run.seed, plan.init)
        log.info("initial weights (model.init %r: %s) in %.1f s", job.model.init, plan.init,
                 time.perf_counter() - began)
        startup.mark("initial_weights")
    dist.broadcast_object_list(flops, src=flops_rank)
    plan = settle_at_start(plan, job, towers, flops_per_sample=flops[0])
    if env.is_main:
        log_auto_layout(job, plan)
    if plan.layout.compile:  # before anything is compiled: a requeue on other nodes starts warm
        loaded = load_compile_cache(job.run_dir / COMPILE_CACHE)
        if loaded and env.is_main:
            log.info("compile cache: %d artifacts from %s", loaded, job.run_dir / COMPILE_CACHE)
    parallelize(model, job.fsdp, plan.layout, mesh, job.model.block_classes)
    float8_scales = gathers_in_float8(job.fsdp, plan.layout, mesh) and not plan.cuda_graph
    startup.mark("parallelized")
    materialize(model, env.device, job.fsdp.cpu_offload, source)
    if job.fsdp.cpu_offload:  # AdamW, clipping and the loss scaler's checks run on the host: give them the cores
        torch.set_num_threads(cores_per_local_rank())
        if env.is_main:
            log.info("cpu offload: the host's optimizer step on %d threads per rank", torch.get_num_threads())
    return BuiltModel(model, decay_groups, flops[0], plan, float8_scales)


def log_auto_layout(job: Job, plan: RunPlan) -> None:
    """What compile and cuda_graph 'auto' settled."""
    fsdp, layout = job.fsdp, plan.layout
    if fsdp.compile == "auto":
        units = "; ".join(f"{tower}: {', '.join(classes) if classes else 'blocks'} × {layout.unit_size[tower]}"
                          for tower, classes in layout.wrap.items())
        log.info("compile 'auto': %s (units %s; reshard_after_forward %s)", "on" if layout.compile else "off",
                 units, str(layout.reshard_after_forward).lower())
    if fsdp.cuda_graph == "auto":
        log.info("cuda_graph 'auto': %s", "on" if plan.cuda_graph else "off" if plan.world_size == 1 else
                 f"off ({plan.world_size} ranks: captured collectives are not measured yet)")


def keep_compile_cache(job: Job) -> None:
    """The compiled artifacts kept in the run directory (after the first step), for a relaunch elsewhere."""
    saved = save_compile_cache(job.run_dir / COMPILE_CACHE)
    if saved:
        log.info("compile cache: %d artifacts kept in %s", saved, job.run_dir / COMPILE_CACHE)
