"""The trainer's checkpoint hooks: saves when due (asynchronous ones paced by the writes), their records, and
resuming with this spec's settings."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from fsdpclip.checkpoint.layout import CheckpointError, DiskFull, checkpoint_name, kept_checkpoint
from fsdpclip.checkpoint.sharded import FAILED, WRITING, rng_state, set_rng_state
from fsdpclip.node import host_memory
from fsdpclip.parallel.distributed import all_max
from fsdpclip.plan.resolved import settle_at_start
from fsdpclip.run.directory import EXIT_CRASH, EXIT_NO_SPACE
from fsdpclip.spec.job import CheckpointSpec
from fsdpclip.spec.resume import checkpoint_changes, is_fixed, kept_streams, shard_fingerprint, unaccepted
from fsdpclip.train.optim import Schedule
from fsdpclip.train.stops import Stop
from fsdpclip.train.state import TrainerState

log = logging.getLogger("fsdpclip")


class Checkpointing(TrainerState):
    """The part of `Trainer` that saves, resumes and reports checkpoint failures."""

    def _asynchronous_saves(self, host_bytes: int, towers) -> bool:
        """Whether periodic saves are asynchronous: the plan's checkpoint.async_save, settled by rank 0 for the
        largest host copy of a rank (`host_bytes` here) and given to every rank; when they are, the host copy's
        memory is reserved now, while the first step compiles."""
        job, env = self.job, self.env
        largest, = all_max([host_bytes], env.device)
        decided: list[Any] = [settle_at_start(self.plan, job, towers, host_copy_bytes=largest) if env.is_main else None]
        dist.broadcast_object_list(decided, src=0)
        self.plan = decided[0]
        if job.checkpoint.async_save == "auto" and job.checkpoint.periodic and env.is_main:
            log.info("checkpoint.async_save 'auto': %s (a host copy of %.1f GiB per rank, %d rank(s) on a node of "
                     "%.0f GiB)", "on" if self.plan.async_save else "off", largest / 2 ** 30, env.local_world_size,
                     host_memory() / 2 ** 30)
        if self.plan.async_save:
            self.checkpointer.host.reserve(host_bytes)
        return self.plan.async_save

    def _minutes_passed(self) -> int:
        """1 on rank 0 once checkpoint.every_minutes have passed since the last save (or the start of `fit`), else
        0: the stop checks share it as a maximum over ranks, so that every rank saves at the same step."""
        minutes = self.job.checkpoint.every_minutes
        return int(bool(minutes) and self.env.is_main and time.monotonic() - self.saved_at >= 60 * minutes)

    def _save_due(self) -> None:
        """Make the checkpoint that is due. An asynchronous one waits, while training goes on, for the write
        before it to end on every rank: saves then follow the disk's pace instead of stopping training."""
        job = self.job
        if self.async_saves:
            writes, = all_max([self.checkpointer.write_status()], self.env.device)
            self._raise_if_write_failed(writes)
            if writes == WRITING:
                return
            if self.save_due != self.step and not self.late_saves and self.env.is_main:
                log.warning("the checkpoint due at step %d is saved at step %d: the write before it took longer than "
                            "the interval between saves (%s), and saves wait for it without stopping training",
                            self.save_due, self.step, save_interval(job.checkpoint))
            self.late_saves += self.save_due != self.step
        self.save(asynchronous=self.async_saves)

    def _raise_if_write_failed(self, writes: int) -> None:
        """The ranks agreed that an asynchronous write failed: each stops (with its own failure where it had one)."""
        if writes != FAILED:
            return
        with self._stop_when_save_fails():
            if self.checkpointer.write_status() == FAILED:
                self.checkpointer.finish_pending(wait=True)
            raise CheckpointError("an asynchronous checkpoint write failed on another rank")

    def save(self, asynchronous: bool = False) -> Path:
        """Checkpoint this step (once), every rank taking part; the resolved spec goes with it."""
        if self.last_saved == self.step:
            return self.checkpointer.root / checkpoint_name(self.step)
        broken, by_source = self._sample_counts()
        meta = {"samples_seen": self.samples_seen, "skipped_steps": int(self.skipped_steps.item()),
                "data_ranks": self.data_ranks, "broken_samples": broken, "source_samples": by_source,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "model": {"label": self.job.model.label, "open_clip_config": self.model_config},
                "job": json.loads(self.job.to_json()), "shards": self.shards}
        rank_state = {"rng": rng_state(self.env.device), "data": self.batches.state_dict()}
        began = time.perf_counter()
        with self._stop_when_save_fails():
            path = self.checkpointer.save(self.step, self.model, self.optimizer, meta, rank_state, asynchronous,
                                          averages=self.ema.state_dict() if self.ema is not None else None)
        self.last_saved, self.saved_at = self.step, time.monotonic()
        if self.metrics is not None:  # what this rank's training waited for, a wait for the save before included
            record = {"step": self.step, "checkpoint": path.name,
                      "checkpoint_blocked_s": round(time.perf_counter() - began, 3),
                      "checkpoint_phases_s": self.checkpointer.phases,
                      "checkpoint_staging": self.checkpointer.staging if asynchronous else "synchronous"}
            if asynchronous and self.save_due not in (None, self.step):
                record["checkpoint_due_step"] = self.save_due
            self.metrics.write(record)
        self.save_due = None
        return path

    def finish_saving(self, wait: bool) -> str:
        """Publish an asynchronous save whose writes are done (or wait for them: `Checkpointer.finish_pending`).
        Waiting, rank 0 also waits for the uploads (checkpoint.remote); returns what the exit message adds where
        the last one failed, else ''."""
        with self._stop_when_save_fails():
            self.checkpointer.finish_pending(wait)
        failure = self.checkpointer.finish_uploads() if wait else None
        return f"; {failure} (it is complete in {self.checkpointer.root})" if failure else ""

    @contextlib.contextmanager
    def _stop_when_save_fails(self):
        """A checkpoint that could not be written as a Stop naming the one kept: exit 74 when it did not fit on
        its disk (DiskFull), else EXIT_CRASH."""
        try:
            yield
        except CheckpointError as exc:
            full = isinstance(exc, DiskFull)
            raise Stop(EXIT_NO_SPACE if full else EXIT_CRASH, f"{exc}; {kept_checkpoint(self.job.run_dir, full)}") \
                from None

    def _resume(self, candidates: list[Path]) -> None:
        """Continue from the newest candidate that loads, with this spec's settings from its step on."""
        for checkpoint in candidates:
            try:
                meta, rank_state, averaged = self.checkpointer.load(
                    checkpoint, self.model, self.optimizer, self.ema.state_dict() if self.ema is not None else None)
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
        self.resumed_from, self.changes = str(checkpoint), [str(c) for c in changes]
        self.step, self.samples_seen, self.last_saved = meta["step"], meta["samples_seen"], meta["step"]
        self.skipped_steps.fill_(meta["skipped_steps"])
        self._resume_average(checkpoint, averaged)
        streams = kept_streams(meta, job, changes, world)
        if streams is not None and streams != self.data_ranks:
            self._close_batches()
            self._open_batches(self.model, start=False, data_ranks=streams)
        self._apply_spec(meta)
        if streams is not None:
            if rank_state is not None:
                set_rng_state(rank_state["rng"], self.env.device)
            from fsdpclip.data.batches import with_worker_count

            self.batches.load_state_dict(with_worker_count(self._data_position(checkpoint, meta, rank_state),
                                                           meta.get("job", {})))
        else:
            why = f"imported from {meta['imported']['source']}" if "imported" in meta else \
                "data or batch changed" if rank_state is not None else \
                f"saved by {meta['world_size']} ranks, this run has {world}"
            log.warning("%s: the data stream restarts at its epoch (%s)", checkpoint, why)
            epoch_samples = job.epoch_samples(world)
            self.batches.restart(self.step * job.batch.grad_accum,
                                 self.samples_seen // epoch_samples if epoch_samples else 0)
            self.counted = meta.get("broken_samples", 0), meta.get("source_samples", {})  # the counts go on
        for change in self.changes:
            log.warning("changed since %s: %s (applied from step %d)", checkpoint.name, change, self.step)
        log.info("resumed from %s at step %d", checkpoint, self.step)

    def _resume_average(self, checkpoint: Path, averaged: bool) -> None:
        """Where the checkpoint and this spec disagree on the moving average (the `ema` block), one line: an average
        started from the resumed weights, or the checkpoint's left unused."""
        if self.ema is not None and not averaged:
            self.ema.restart()
            if self.env.is_main:
                log.warning("%s holds no moving average of the weights: the `ema` block's starts from its weights at "
                            "step %d", checkpoint.name, self.step)
        elif self.ema is None and averaged and self.env.is_main:
            log.info("%s holds a moving average of the weights, left unused: this spec's `ema` is 'auto'",
                     checkpoint.name)

    def _data_position(self, checkpoint: Path, meta: dict, rank_state: Optional[dict]) -> dict:
        """This rank's saved data position, for the data streams it reads: its own rank state's, or, resumed on
        another world size, those of the streams it goes on with from the rank states that hold them."""
        if rank_state is not None:
            return rank_state["data"]
        saved_world = meta["world_size"]
        per_saved_rank = meta.get("data_ranks", saved_world) // saved_world
        hosted = self.data_ranks // self.env.world_size
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

    def _apply_spec(self, meta: dict) -> None:
        """This spec's optimizer settings, schedule and length from the resumed step on (a checkpoint
        carries state, never settings): the length in samples for epochs, the scaler's state kept."""
        job = self.job
        for group, decay in zip(self.optimizer.param_groups, self.decay_groups):
            group.update(betas=job.optimizer.betas, eps=job.optimizer.eps, weight_decay=decay.weight_decay)
        self.total_steps = job.length(self.env.world_size, self.step, self.samples_seen, self.data_ranks)
        self.scheduler = Schedule(self.optimizer, job.schedule, job.optimizer.lr, self.total_steps)
        self.scheduler.set_step(self.step)
        if self.scaler is not None and meta["scaler"] is not None:
            self.scaler.load_state_dict(meta["scaler"])


def save_interval(spec: CheckpointSpec) -> str:
    """checkpoint.every_steps and every_minutes in words, those set."""
    return " or ".join(f"checkpoint.{name} {value:g}" for name, value in
                       (("every_steps", spec.every_steps), ("every_minutes", spec.every_minutes)) if value)
