"""The trainer's model set-up: the mesh, the initial weights, what 'auto' decides and the parallelized model."""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist

from fsdpclip.model.build import training_flops_per_sample
from fsdpclip.model.trainable import trainable_decay_groups
from fsdpclip.model.weights import initial_model
from fsdpclip.parallel.distributed import shard_mesh
from fsdpclip.node import cores_per_local_rank
from fsdpclip.parallel.parallelize import COMPILE_CACHE, load_compile_cache, materialize, parallelize, resolve_auto, \
    save_compile_cache
from fsdpclip.plan.memory import GIB
from fsdpclip.plan.mesh import ShardDegreeError, auto_shard_degree, memory_model, resolve_shard_degree
from fsdpclip.run.directory import EXIT_SPEC
from fsdpclip.spec.job import FsdpSpec
from fsdpclip.train.stops import Stop
from fsdpclip.train.state import TrainerState

log = logging.getLogger("fsdpclip")


class ModelBuilding(TrainerState):
    """The part of `Trainer` that builds the sharded model (`_build_model`)."""

    def _build_model(self, model: torch.nn.Module, towers) -> torch.nn.Module:
        """The sharded model with its initial weights, from the frozen meta-device model every rank
        built: decay groups and FLOPs taken on the original names (and per_gpu 'auto''s start planned, where
        it applies: train.sizing), parallelized, then filled from rank 0.
        The last rank counts the FLOPs while rank 0 draws the initial weights."""
        job, env = self.job, self.env
        self.decay_groups = trainable_decay_groups(model, job.optimizer)
        self.shard_degree = self._shard_degree(model, towers)
        self.mesh = shard_mesh(env, self.shard_degree)
        self.planned_per_gpu = self._plan_batch(model, towers) if job.batch.searched else job.batch.settled_per_gpu
        if env.is_main:
            log.info("mesh: %d replica(s) × shard groups of %d", env.world_size // self.shard_degree, self.shard_degree)
        flops_rank = env.world_size - 1
        flops: list = [training_flops_per_sample(model) if env.rank == flops_rank else None]
        source = None
        if env.is_main:
            began = time.perf_counter()
            source = initial_model(job.model, job.run.seed)
            log.info("initial weights (model.init %r) in %.1f s", job.model.init, time.perf_counter() - began)
            self.startup.mark("initial_weights")
        dist.broadcast_object_list(flops, src=flops_rank)
        self.flops_per_sample = flops[0]
        fsdp = self._resolve_auto(model, towers)
        self.compiled, self.cuda_graph = bool(fsdp.compile), fsdp.cuda_graph
        if self.compiled:  # before anything is compiled: a requeue on other nodes starts warm
            loaded = load_compile_cache(job.run_dir / COMPILE_CACHE)
            if loaded and env.is_main:
                log.info("compile cache: %d artifacts from %s", loaded, job.run_dir / COMPILE_CACHE)
        parallelize(model, fsdp, self.mesh, job.model.block_classes)
        self.startup.mark("parallelized")
        materialize(model, env.device, job.fsdp.cpu_offload, source)
        if job.fsdp.cpu_offload:  # AdamW, clipping and the loss scaler's checks run on the host: give them the cores
            torch.set_num_threads(cores_per_local_rank())
            if env.is_main:
                log.info("cpu offload: the host's optimizer step on %d threads per rank", torch.get_num_threads())
        return model

    def _keep_compile_cache(self) -> None:
        """The compiled artifacts kept in the run directory (after the first step), for a relaunch elsewhere."""
        saved = save_compile_cache(self.job.run_dir / COMPILE_CACHE)
        if saved:
            log.info("compile cache: %d artifacts kept in %s", saved, self.job.run_dir / COMPILE_CACHE)

    def _resolve_auto(self, model: torch.nn.Module, towers) -> FsdpSpec:
        """job.fsdp with its 'auto' compile and cuda_graph decided on rank 0 (parallelize.resolve_auto), the
        same on every rank; where towers are too large to compile whole, also from the work of one block's
        forward over a micro batch (the model's FLOPs spread over its blocks)."""
        job, env = self.job, self.env
        decided: list = [None]  # rank 0's FsdpSpec, broadcast
        if env.is_main:
            blocks = max(1, sum(len(tower.blocks) for tower in towers.values()))
            block_flops = self.flops_per_sample / 3 * self.planned_per_gpu / blocks  # forward is a third of training
            decided[0] = resolve_auto(job.fsdp, model, towers, env.device.type, block_flops,
                                      world_size=env.world_size)
            fsdp = decided[0]
            if job.fsdp.compile == "auto":
                how = "off" if not fsdp.compile else "blocks" if fsdp.wrap == job.fsdp.wrap else \
                    f"whole towers ({fsdp.wrap.image and fsdp.wrap.image[0]}, " \
                    f"{fsdp.wrap.text and fsdp.wrap.text[0]}; reshard_after_forward " \
                    f"{str(fsdp.reshard_after_forward).lower()})"
                log.info("compile 'auto': %s (%.2f TFLOP per block forward)", how, block_flops / 1e12)
            if job.fsdp.cuda_graph == "auto":
                log.info("cuda_graph 'auto': %s", "on" if fsdp.cuda_graph else "off" if env.world_size == 1 else
                         f"off ({env.world_size} ranks: captured collectives are not measured yet)")
        dist.broadcast_object_list(decided, src=0)
        return decided[0]

    def _shard_degree(self, model: torch.nn.Module, towers) -> int:
        """fsdp.shard_degree, or what 'auto' chooses: the whole world when it fits in one node, else
        rank 0 decides as `validate` does, from launch.gpu_memory_gib (else the GPU's memory; full
        sharding when neither is known), and tells every rank, so that all build the same mesh."""
        job, env = self.job, self.env

        def auto() -> int:
            decided: list = [None]  # rank 0's degree, broadcast
            if env.is_main:
                limit = job.launch.gpu_memory_gib
                capacity = limit * GIB if limit else torch.cuda.get_device_properties(env.device).total_memory \
                    if env.device.type == "cuda" else None
                memory, _ = memory_model(job, model, towers)
                decided[0] = auto_shard_degree(memory, env.world_size, env.local_world_size, capacity)
            dist.broadcast_object_list(decided, src=0)
            return decided[0]

        try:
            return resolve_shard_degree(job.fsdp.shard_degree, env.world_size, env.local_world_size, auto)
        except ShardDegreeError as exc:
            raise Stop(EXIT_SPEC, f"fsdp.shard_degree {job.fsdp.shard_degree}: {exc}") from None
