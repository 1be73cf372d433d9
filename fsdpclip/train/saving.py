"""The trainer's checkpoints (`CheckpointManager`): what is saved (`TrainingState`, the run's `Progress` among it),
saves when due (asynchronous ones paced by the writes), their records, and resuming with this spec's settings."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

from fsdpclip.checkpoint.layout import CheckpointError, DiskFull, checkpoint_name, kept_checkpoint
from fsdpclip.checkpoint.sharded import FAILED, WRITING, Checkpointer, rng_state, set_rng_state
from fsdpclip.model.build import OpenClip
from fsdpclip.run.node import host_memory
from fsdpclip.parallel.distributed import Dist, all_max
from fsdpclip.plan.resolved import RunPlan, settle_at_start
from fsdpclip.run.directory import EXIT_CRASH, EXIT_NO_SPACE
from fsdpclip.jobspec.job import CheckpointSpec, Job
from fsdpclip.jobspec.resume import checkpoint_changes, is_fixed, kept_streams, shard_fingerprint, unaccepted
from fsdpclip.optim.ema import ShardedEma
from fsdpclip.train.feeding import DataFeed
from fsdpclip.train.metrics import MetricsLog
from fsdpclip.optim.adamw import ShardedAdamW
from fsdpclip.train.stops import Stop

log = logging.getLogger("fsdpclip")


@dataclass
class Progress:
    """How far the run has come: optimizer steps taken, samples trained on, and non-finite steps skipped (counted
    on the device)."""

    skipped_steps: torch.Tensor
    step: int = 0
    samples_seen: int = 0

    def advance(self, samples: int, skipped: Optional[torch.Tensor] = None) -> None:
        """One optimizer step more, of `samples` samples; `skipped`: 1 (on the device) where it was skipped."""
        if skipped is not None:
            self.skipped_steps += skipped
        self.step += 1
        self.samples_seen += samples

    def restore(self, meta: dict) -> None:
        """Where a checkpoint's meta says the run was."""
        self.step, self.samples_seen = meta["step"], meta["samples_seen"]
        self.skipped_steps.fill_(meta["skipped_steps"])


@dataclass(frozen=True)
class TrainingState:
    """Everything a checkpoint saves of training and a resume puts back: the sharded model and AdamW (the
    checkpoint's tensors), the loss scaler (None without one) and the run's progress (its meta), the data's
    position (each rank's state, with its RNG) and counts, and the moving average of the weights (None without
    the `ema` block)."""

    model: OpenClip
    optimizer: ShardedAdamW
    scaler: Optional[Any]
    progress: Progress
    data: DataFeed
    ema: Optional[ShardedEma]  # the `ema` block's moving average, or None


def settle_async_saves(job: Job, env: Dist, plan: RunPlan, towers, checkpointer: Checkpointer,
                       host_bytes: int) -> RunPlan:
    """The plan with checkpoint.async_save settled by rank 0 for the largest host copy of a rank (`host_bytes`
    here) and given to every rank; where saves are asynchronous, the host copy's memory is reserved now, while the
    first step compiles."""
    largest, = all_max([host_bytes], env.device)
    decided: list[Any] = [settle_at_start(plan, job, towers, host_copy_bytes=largest) if env.is_main else None]
    dist.broadcast_object_list(decided, src=0)
    plan = decided[0]
    if job.checkpoint.async_save == "auto" and job.checkpoint.periodic and env.is_main:
        log.info("checkpoint.async_save 'auto': %s (a host copy of %.1f GiB per rank, %d rank(s) on a node of "
                 "%.0f GiB)", "on" if plan.async_save else "off", largest / 2 ** 30, env.local_world_size,
                 host_memory() / 2 ** 30)
    if plan.async_save:
        checkpointer.host.reserve(host_bytes)
    return plan


class CheckpointManager:
    """Saves and resumes `state` through `checkpointer` (every rank takes part): periodic saves asynchronous where
    `asynchronous`, the spec and the model's OpenCLIP config (`model_config`) saved with each."""

    def __init__(self, job: Job, env: Dist, checkpointer: Checkpointer, state: TrainingState, model_config: dict,
                 asynchronous: bool):
        self.job, self.env, self.checkpointer, self.state = job, env, checkpointer, state
        self.model_config, self.asynchronous = model_config, asynchronous
        self.shards = self._shard_fingerprint()
        self.last_saved: Optional[int] = None
        self.save_due: Optional[int] = None  # the step whose checkpoint is due and not yet made
        self.late_saves = 0
        self.saved_at = time.monotonic()  # checkpoint.every_minutes count from here (`start`), then from each save
        self.metrics: Optional[MetricsLog] = None  # where saves write their time, once training runs

    def start(self, metrics: MetricsLog) -> None:
        """Training starts: saves write their time to `metrics`, and checkpoint.every_minutes count from now."""
        self.metrics, self.saved_at = metrics, time.monotonic()

    # ------------------------------------------------------------------ saving
    def minutes_passed(self) -> int:
        """1 on rank 0 once checkpoint.every_minutes have passed since the last save (or the start of training),
        else 0: the stop checks share it as a maximum over ranks, so that every rank saves at the same step."""
        minutes = self.job.checkpoint.every_minutes
        return int(bool(minutes) and self.env.is_main and time.monotonic() - self.saved_at >= 60 * minutes)

    def mark_due(self) -> None:
        """A checkpoint is due at this step (unless one due earlier is not made yet)."""
        self.save_due = self.save_due or self.state.progress.step

    def save_if_due(self) -> None:
        """Make the checkpoint due at this step (checkpoint.every_steps) or earlier. An asynchronous one waits, while
        training goes on, for the write before it to end on every rank: saves then follow the disk's pace instead
        of stopping training."""
        step, every = self.state.progress.step, self.job.checkpoint.every_steps
        if every and step % every == 0:
            self.mark_due()
        if not self.save_due:
            return
        if self.asynchronous:
            writes, = all_max([self.checkpointer.write_status()], self.env.device)
            self.raise_if_write_failed(writes)
            if writes == WRITING:
                return
            if self.save_due != step and not self.late_saves and self.env.is_main:
                log.warning("the checkpoint due at step %d is saved at step %d: the write before it took longer than "
                            "the interval between saves (%s), and saves wait for it without stopping training",
                            self.save_due, step, save_interval(self.job.checkpoint))
            self.late_saves += self.save_due != step
        self.save(asynchronous=self.asynchronous)

    def write_status(self) -> int:
        """This rank's asynchronous write: `checkpoint.sharded` IDLE, WRITING or FAILED."""
        return self.checkpointer.write_status()

    def raise_if_write_failed(self, writes: int) -> None:
        """The ranks agreed that an asynchronous write failed: each stops (with its own failure where it had one)."""
        if writes != FAILED:
            return
        with stop_when_save_fails(self.job):
            if self.checkpointer.write_status() == FAILED:
                self.checkpointer.finish_pending(wait=True)
            raise CheckpointError("an asynchronous checkpoint write failed on another rank")

    def save(self, asynchronous: bool = False) -> Path:
        """Checkpoint this step (once), every rank taking part; the resolved spec goes with it."""
        state, progress = self.state, self.state.progress
        if self.last_saved == progress.step:
            return self.checkpointer.root / checkpoint_name(progress.step)
        broken, by_source = state.data.sample_counts()
        meta = {"samples_seen": progress.samples_seen, "skipped_steps": int(progress.skipped_steps.item()),
                "data_ranks": state.data.data_ranks, "broken_samples": broken, "source_samples": by_source,
                "scaler": state.scaler.state_dict() if state.scaler is not None else None,
                "model": {"label": self.job.model.label, "open_clip_config": self.model_config},
                "job": json.loads(self.job.to_json()), "shards": self.shards}
        rank_state = {"rng": rng_state(self.env.device), "data": state.data.state_dict()}
        began = time.perf_counter()
        with stop_when_save_fails(self.job):
            path = self.checkpointer.save(progress.step, state.model, state.optimizer, meta, rank_state, asynchronous,
                                          averages=state.ema.state_dict() if state.ema is not None else None)
        self.last_saved, self.saved_at = progress.step, time.monotonic()
        if self.metrics is not None:  # what this rank's training waited for, a wait for the save before included
            record = {"step": progress.step, "checkpoint": path.name,
                      "checkpoint_blocked_s": round(time.perf_counter() - began, 3),
                      "checkpoint_phases_s": self.checkpointer.phases,
                      "checkpoint_staging": self.checkpointer.staging if asynchronous else "synchronous"}
            if asynchronous and self.save_due not in (None, progress.step):
                record["checkpoint_due_step"] = self.save_due
            self.metrics.write(record)
        self.save_due = None
        return path

    def finish_saving(self, wait: bool) -> str:
        """Publish an asynchronous save whose writes are done (or wait for them: `Checkpointer.finish_pending`).
        Waiting, rank 0 also waits for the uploads (checkpoint.remote); returns what the exit message adds where
        the last one failed, else ''."""
        with stop_when_save_fails(self.job):
            self.checkpointer.finish_pending(wait)
        failure = self.checkpointer.finish_uploads() if wait else None
        return f"; {failure} (it is complete in {self.checkpointer.root})" if failure else ""

    # ---------------------------------------------------------------- resuming
    def resume(self, candidates: list[Path]) -> tuple[str, list[str]]:
        """Continue from the newest candidate that loads: the state as saved, the data where it stopped (or its
        epoch again). Returns the checkpoint and what this spec changes in it, applied from its step on (the
        trainer applies this spec's settings: a checkpoint carries state, never settings)."""
        state, progress = self.state, self.state.progress
        for checkpoint in candidates:
            try:
                meta, rank_state, averaged = self.checkpointer.load(
                    checkpoint, state.model, state.optimizer, state.ema.state_dict() if state.ema is not None else None)
                break
            except CheckpointError as exc:
                log.warning("%s: trying the checkpoint before it", exc)
        else:
            raise CheckpointError(f"none of {', '.join(str(c) for c in candidates)} could be loaded")
        job, world = self.job, self.env.world_size
        changes = checkpoint_changes(meta, job, self.model_config, lambda: self.shards, world)
        fixed = [str(c) for c in changes if is_fixed(c)]
        if fixed:
            raise CheckpointError(f"{checkpoint} was trained with another model or optimizer layout "
                                  f"({'; '.join(fixed)}): resume it with its own, or start a new run")
        refused = unaccepted(changes, job)
        if refused:
            raise CheckpointError(f"resuming {checkpoint} on {world} rank(s) with this spec changes the run "
                                  f"({'; '.join(map(str, refused))}): `fsdpclip launch` keeps the global batch on "
                                  "another world size where the ranks divide it; --accept-changes "
                                  "(checkpoint.accept_changes) resumes anyway")
        progress.restore(meta)
        self.last_saved = meta["step"]
        self._resume_average(checkpoint, averaged)
        streams = kept_streams(meta, job, changes, world)
        if streams is not None and streams != state.data.data_ranks:
            state.data.reopen(streams)
        if state.scaler is not None and meta["scaler"] is not None:
            state.scaler.load_state_dict(meta["scaler"])
        if streams is not None:
            if rank_state is not None:
                set_rng_state(rank_state["rng"], self.env.device)
            from fsdpclip.data.batches import with_worker_count

            state.data.load_state_dict(with_worker_count(self._data_position(checkpoint, meta, rank_state),
                                                         meta.get("job", {})))
        else:
            why = f"imported from {meta['imported']['source']}" if "imported" in meta else \
                "data or batch changed" if rank_state is not None else \
                f"saved by {meta['world_size']} ranks, this run has {world}"
            log.warning("%s: the data stream restarts at its epoch (%s)", checkpoint, why)
            epoch_samples = job.epoch_samples(world)
            state.data.restart(progress.step * job.batch.grad_accum,
                               progress.samples_seen // epoch_samples if epoch_samples else 0,
                               (meta.get("broken_samples", 0), meta.get("source_samples", {})))  # the counts go on
        for change in changes:
            log.warning("changed since %s: %s (applied from step %d)", checkpoint.name, change, progress.step)
        log.info("resumed from %s at step %d", checkpoint, progress.step)
        return str(checkpoint), [str(c) for c in changes]

    def _resume_average(self, checkpoint: Path, averaged: bool) -> None:
        """Where the checkpoint and this spec disagree on the moving average (the `ema` block), one line: an average
        started from the resumed weights, or the checkpoint's left unused."""
        if self.state.ema is not None and not averaged:
            self.state.ema.restart()
            if self.env.is_main:
                log.warning("%s holds no moving average of the weights: the `ema` block's starts from its weights at "
                            "step %d", checkpoint.name, self.state.progress.step)
        elif self.state.ema is None and averaged and self.env.is_main:
            log.info("%s holds a moving average of the weights, left unused: this spec's `ema` is 'auto'",
                     checkpoint.name)

    def _data_position(self, checkpoint: Path, meta: dict, rank_state: Optional[dict]) -> dict:
        """This rank's saved data position, for the data streams it reads: its own rank state's, or, resumed on
        another world size, those of the streams it goes on with from the rank states that hold them."""
        if rank_state is not None:
            return rank_state["data"]
        saved_world = meta["world_size"]
        per_saved_rank = meta.get("data_ranks", saved_world) // saved_world
        hosted = self.state.data.data_ranks // self.env.world_size
        streams = range(self.env.rank * hosted, (self.env.rank + 1) * hosted)
        saved_ranks = sorted({stream // per_saved_rank for stream in streams})
        states = dict(zip(saved_ranks, self.checkpointer.read_rank_states(checkpoint, saved_ranks)))
        positions = {}
        for rank, state in states.items():
            positions.update(state["data"]["streams"] if per_saved_rank > 1 else {str(rank): state["data"]})
        if hosted == 1:
            return positions[str(self.env.rank)]
        return {"streams": {str(stream): positions[str(stream)] for stream in streams}}

    def _shard_fingerprint(self) -> Optional[dict]:
        """`resume.shard_fingerprint` of this run's shards, taken by rank 0 (one stat per shard) and given to
        every rank: all must agree on whether a saved data position still holds."""
        found = [shard_fingerprint(self.job) if self.env.is_main else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]


@contextlib.contextmanager
def stop_when_save_fails(job: Job):
    """A checkpoint that could not be written as a Stop naming the one kept: exit 74 when it did not fit on its
    disk (DiskFull), else EXIT_CRASH."""
    try:
        yield
    except CheckpointError as exc:
        full = isinstance(exc, DiskFull)
        raise Stop(EXIT_NO_SPACE if full else EXIT_CRASH, f"{exc}; {kept_checkpoint(job.run_dir, full)}") from None


def save_interval(spec: CheckpointSpec) -> str:
    """checkpoint.every_steps and every_minutes in words, those set."""
    return " or ".join(f"checkpoint.{name} {value:g}" for name, value in
                       (("every_steps", spec.every_steps), ("every_minutes", spec.every_minutes)) if value)
