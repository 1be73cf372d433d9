"""The trainer's `batch.per_gpu: "auto"`: the batch the GPUs fit, found with real steps at start
(`plan.batch` holds the search), or the one an earlier launch of the run recorded for the same spec, world
and GPU.

A probe is one optimizer step of the parallelized model (its units, activation checkpointing, CPU offload)
at a batch of random inputs: forward and backward of one micro batch (two where the step accumulates),
then AdamW at learning rate 0 (the weights stay as drawn) on an optimizer dropped afterwards; the forward runs
in train mode, as the step's does, and the batch norms' running statistics it moved are put back. Its moments
are allocated before the forward, as every training step after the first holds them (left out, the peak
missed 8 bytes per parameter: ViT-bigG-14's 19 GiB). Compiled modules run eager for the probes
(`torch.compiler.set_stance`): compiling every probed shape would take minutes, and the compiled step keeps
fewer activations than the eager one, so what fits eager fits compiled. An out-of-memory error is a probe
that does not fit. Every rank probes the same batch and the ranks agree on the smallest result and the
largest peak (all-reduce): a batch fits only where it fits on every GPU.

Where FSDP can recover from running out of memory (`reset_iter_state`: in torch 2.14, not in 2.11), the
failed probe's memory is handed back (that, and the allocator's cache emptied) and the search goes on past
it. Elsewhere an FSDP module left by a failed step cannot run another, so the search probes only batches
whose peak the measured peaks predict under `PEAK_MARGIN` of the GPU's memory, and a probe that runs out of
memory all the same ends the run with one line (`plan.batch.settled_batch`).
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from fsdpclip.model.build import OpenClip, image_shape, text_shape
from fsdpclip.model.trainable import DecayGroup
from fsdpclip.parallel.distributed import Dist
from fsdpclip.plan.batch import (
    PEAK_MARGIN, BatchRecord, BatchSearchFailed, Probe, micro_batches_probed, recorded_batch, search_basis,
    settled_batch,
)
from fsdpclip.plan.memory import GIB
from fsdpclip.plan.resolved import RunPlan, settle_at_start
from fsdpclip.run.directory import EXIT_SPEC
from fsdpclip.jobspec.job import Job
from fsdpclip.train.building import BuiltModel
from fsdpclip.train.loss import backward_micro_batches, build_loss
from fsdpclip.optim.adamw import build_optimizer
from fsdpclip.train.stops import Stop

log = logging.getLogger("fsdpclip")


@dataclass(frozen=True)
class SettledBatch:
    """What per_gpu 'auto' settled: the run plan with the batch (its `per_gpu` and `grad_accum`), and on rank 0 the
    first log record's account of it (`auto_batch`: the batch, the search's seconds, whether a record was reused);
    None on the other ranks."""

    plan: RunPlan
    report: Optional[dict]


class BatchSizing:
    """`batch.per_gpu: "auto"` on this rank: the batch an earlier launch recorded (`recorded`, which the run plan
    starts from), then the batch settled once the model is built (`settle`)."""

    def __init__(self, job: Job, env: Dist):
        self.job, self.env = job, env
        self.basis: dict = {}  # rank 0's: what a record applies to (`plan.batch.search_basis`)
        self.record: Optional[BatchRecord] = None  # rank 0's: an earlier launch's record that applies

    def recorded(self) -> Optional[tuple[int, int]]:
        """On rank 0, with per_gpu 'auto': the batch an earlier launch of this run recorded for the same spec, world
        and GPU (kept in `record`), else None."""
        job, env = self.job, self.env
        if not job.batch.searched:
            return None
        properties = torch.cuda.get_device_properties(env.device)
        self.basis = search_basis(job, env.world_size, f"{properties.name}, {properties.total_memory} bytes")
        self.record = recorded_batch(job.run_dir, self.basis)
        return (self.record.per_gpu, self.record.grad_accum) if self.record else None

    def settle(self, built: BuiltModel) -> SettledBatch:
        """The built model's plan with the batch settled: the recorded one, else searched now from where the plan
        starts it (and recorded by rank 0)."""
        job, env, plan = self.job, self.env, built.plan
        searched = "per_gpu" in plan.pending
        record = self.record
        if searched:
            began, probes = time.perf_counter(), []
            budget = None if hasattr(built.model, "reset_iter_state") else self._peak_budget()
            try:
                per_gpu, accum = settled_batch(lambda per_gpu: self._fits(built, per_gpu, probes), job,
                                               env.world_size, plan.per_gpu, budget)
            except BatchSearchFailed as failed:
                raise Stop(EXIT_SPEC, str(failed)) from None
            record = BatchRecord(per_gpu, accum, round(time.perf_counter() - began, 1), plan.per_gpu,
                                 self.basis if env.is_main else {}, probes)
            if env.is_main:
                record.save(job.run_dir)
            plan = settle_at_start(plan, job, {}, batch=(per_gpu, accum))
        if not env.is_main:
            return SettledBatch(plan, None)
        assert record is not None  # searched now or recorded earlier: per_gpu 'auto' settles one or the other
        how = f"searched in {record.searched_s:.1f} s from {record.start}: " + ", ".join(
            f"{p.per_gpu} {'fits' if p.fits else 'out of memory'}" for p in record.probes) \
            if searched else "recorded by an earlier launch of this run"
        log.info("batch.per_gpu 'auto': %d per GPU × %d accumulation (%s)", record.per_gpu, record.grad_accum, how)
        return SettledBatch(plan, {"per_gpu": record.per_gpu, "grad_accum": record.grad_accum,
                                   "searched_s": record.searched_s, "reused": not searched})

    def _peak_budget(self) -> float:
        """The bytes a probe's predicted peak may reach: PEAK_MARGIN of the memory this process's allocator can
        have (what is free and what it holds, no more than `launch.gpu_memory_gib`), the smallest over ranks."""
        device, declared = self.env.device, self.job.launch.gpu_memory_gib
        free, _ = torch.cuda.mem_get_info(device)
        room = free + torch.cuda.memory_reserved(device)
        budget = torch.tensor(PEAK_MARGIN * min(room, declared * GIB if declared else room), device=device)
        dist.all_reduce(budget, op=dist.ReduceOp.MIN)
        return budget.item()

    def _fits(self, built: BuiltModel, per_gpu: int, probes: list[Probe]) -> tuple[bool, float]:
        """Whether a step of `per_gpu` fits on every rank, and its largest peak over the ranks in bytes (one probe
        each, agreed)."""
        env = self.env
        began = time.perf_counter()
        torch.cuda.reset_peak_memory_stats(env.device)
        fits = self.probe_step(built.model, built.decay_groups, per_gpu)
        agreed = torch.tensor([float(fits), -float(torch.cuda.max_memory_allocated(env.device))], device=env.device,
                              dtype=torch.float64)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)  # fits on every rank, the largest peak
        fits, peak = bool(agreed[0].item()), -agreed[1].item()
        probes.append(Probe(per_gpu, fits, round(peak / GIB, 2), round(time.perf_counter() - began, 2)))
        return fits, peak

    def probe_step(self, model: OpenClip, decay_groups: list[DecayGroup], per_gpu: int) -> bool:
        """One step of `model` at `per_gpu` on random inputs, the weights unchanged; False on running out of
        memory."""
        job, env = self.job, self.env
        optimizer = build_optimizer(model, decay_groups, job.optimizer)
        for group in optimizer.param_groups:
            group["lr"] = 0.0  # AdamW's update and its decoupled weight decay both scale with it
        context, vocabulary = text_shape(model)
        images = torch.randn(per_gpu, *image_shape(model), device=env.device)
        texts = torch.randint(vocabulary, (per_gpu, context), device=env.device)
        batches = [(images, texts)] * micro_batches_probed(job, env.world_size, per_gpu)
        try:
            optimizer.allocate_state()  # held through every training step's forward and backward but the first
            with torch.compiler.set_stance("force_eager"), running_statistics_kept(model):
                backward_micro_batches(model, build_loss(job.loss, env.rank, env.world_size), batches, None)
            optimizer.step()
            torch.cuda.synchronize(env.device)
            fits = True
        except torch.cuda.OutOfMemoryError:  # left here, so that nothing holds the failed step's tensors
            fits = False
            if hasattr(model, "reset_iter_state"):  # else the search ends here (the module docstring says why)
                model.reset_iter_state()  # FSDP's supported recovery: units resharded, the step's state cleared
        optimizer.zero_grad(set_to_none=True)
        del optimizer, images, texts, batches
        gc.collect()
        torch.cuda.empty_cache()
        return fits


@contextmanager
def running_statistics_kept(model: torch.nn.Module) -> Iterator[None]:
    """Inside, forwards in train mode may move the batch norms' running statistics (a ModifiedResNet's, a timm
    ConvNet's); on leaving, they are as they were."""
    saved = [(buffer, buffer.clone()) for module in model.modules()
             if isinstance(module, torch.nn.modules.batchnorm._NormBase) and module.track_running_stats
             for buffer in module.buffers(recurse=False)]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
