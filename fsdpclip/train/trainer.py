"""One rank's training: the Trainer (model, data, optimizer, checkpoints, evaluation) and its loop.

Started by fsdpclip.train.entry, the rank entry point, which imports this module on a thread while the
process group forms; its exit codes are listed there.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import time
from collections import deque
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from fsdpclip.checkpoint.sharded import (
    FAILED, WRITING, CheckpointError, Checkpointer, DiskFull, checkpoint_name, host_copy_bytes, latest_checkpoint,
    rng_state, set_rng_state,
)
from fsdpclip.eval.tasks import evaluate_set, load_eval_set, result_line
from fsdpclip.model.build import build_tokenizer, image_transform, model_config
from fsdpclip.model.trainable import frozen_meta_model, trainable_decay_groups
from fsdpclip.model.weights import initial_model
from fsdpclip.parallel.cuda_graphs import GraphedForwardBackward
from fsdpclip.parallel.distributed import Dist, all_max, all_mean, all_sum, shard_mesh
from fsdpclip.parallel.parallelize import (
    COMPILE_CACHE, average_replicated_gradients, load_compile_cache, materialize, parallelize, replicated_parameters,
    resolve_auto, save_compile_cache,
)
from fsdpclip.plan.memory import GIB
from fsdpclip.plan.mesh import ShardDegreeError, auto_shard_degree, memory_model, resolve_shard_degree
from fsdpclip.run.directory import EXIT_CRASH, EXIT_NONFINITE, EXIT_NO_SPACE, EXIT_OK, EXIT_PREEMPTED, EXIT_SPEC
from fsdpclip.run.lock import HeldLock, RunLocked, StartupClock, launch_time, launcher_gone, lock_token
from fsdpclip.run.reports import record_launch, stop_requested, write_exit_report
from fsdpclip.spec.job import FsdpSpec, Job
from fsdpclip.spec.registry import DATA_SOURCES, RankData
from fsdpclip.spec.resume import checkpoint_changes, is_fixed, keeps_data_position, shard_fingerprint
from fsdpclip.train.loss import backward_micro_batches, build_loss
from fsdpclip.train.metrics import MetricsLog, Window, peak_memory_gib, peak_tflops, training_flops_per_sample
from fsdpclip.train.optim import Schedule, build_grad_scaler, build_optimizer, clip_gradients

log = logging.getLogger("fsdpclip")
LOGIT_SCALE_MAX = math.log(100)  # OpenCLIP clamps the learned temperature to at most 100
STOP_REQUEST = 1000  # in the stop agreement (a maximum over ranks): a stop asked for through RUN_DIR/stop
LAUNCHER_GONE = 1001  # ... the `fsdpclip launch` that started a rank has ended (killed) while it runs
# Ranks agree on a stop signal after each launch's first step, then every STOP_CHECK_STEPS steps at most:
# one small blocking collective, whose cost is negligible at this interval, and no extra process group (a
# gloo group connects every pair of ranks, which does not scale). Where steps are slow, more often: about
# STOP_CHECK_SECONDS apart, or every step (a scheduler's grace between SIGTERM and SIGKILL is 30 s by
# default on Slurm; ten 10-second steps of a 10B model would outlast it).
STOP_CHECK_STEPS = 10
STOP_CHECK_SECONDS = 10.0


class Stop(Exception):
    """The run ends early on purpose, with an exit code and a message for the user."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class Trainer:
    """One rank's share of a sharded training run, built from the job spec."""

    def __init__(self, job: Job, env: Dist, signals=None, startup: Optional[StartupClock] = None):
        """`signals`: what tells the loop a stop signal came (fsdpclip.train.entry.StopSignals: `received`)."""
        self.job, self.env, self.signals = job, env, signals
        if job.fsdp.cuda_graph is True and env.device.type != "cuda":
            raise Stop(EXIT_SPEC, "fsdp.cuda_graph true needs CUDA devices")
        self.startup = startup or StartupClock()
        self.model_config = model_config(job.model)
        self.checkpointer = Checkpointer(job.run_dir, job.checkpoint, env.rank, env.world_size)
        candidates = self.checkpointer.resume_candidates()
        meta_model, towers = frozen_meta_model(self.model_config, job)
        self.startup.mark("meta_model")
        self.tokenizer = build_tokenizer(self.model_config)
        self.batches = self._batches(meta_model)
        self.batch_iter: Iterator = iter(self.batches)
        if not candidates:
            self.batches.start()  # a fresh run's data workers fill their queues while the model is built
        try:
            self._set_up(meta_model, towers, candidates)
        except BaseException:  # the data workers ignore stop signals: none may outlive a start that failed
            self.close()
            raise

    def _set_up(self, meta_model: torch.nn.Module, towers, candidates: list[Path]) -> None:
        """Everything after the data: the sharded model, optimizer, schedule, scaler and loss, then the
        resumed state."""
        job, env = self.job, self.env
        self.model = self._build_model(meta_model, towers)
        self.startup.mark("model")
        torch.manual_seed(job.run.seed + 1 + env.rank)  # dropout differs between ranks
        self.total_steps = job.total_steps(env.world_size)
        self.optimizer = build_optimizer(self.model, self.decay_groups, job.optimizer)
        self.scheduler = Schedule(self.optimizer, job.schedule, job.optimizer.lr, self.total_steps)
        # The trained parameters, and those every rank holds whole, listed once (not walked each step).
        self.trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.replicated = [p for p in replicated_parameters(self.model) if p.requires_grad]
        if job.checkpoint.async_save:  # the host copy's memory, made while the first step compiles
            self.checkpointer.host.reserve(host_copy_bytes(self.model, self.trained))
        self.scaler = build_grad_scaler(job.fsdp, env.device)
        self.loss_fn = build_loss(job.loss, env.rank, env.world_size)
        self.forward_backward = GraphedForwardBackward(self._forward_backward, self.trained) if self.cuda_graph \
            else self._forward_backward
        self.eval_sets: Optional[list] = None  # loaded by their tasks
        self.step = self.samples_seen = 0
        self.skipped_steps = torch.zeros((), device=env.device)  # non-finite steps skipped, counted on the device
        self.peak = peak_tflops(env.device, job.logging.peak_tflops)
        self.last_saved: Optional[int] = None
        self.save_due: Optional[int] = None  # the step whose checkpoint is due and not yet made
        self.late_saves = 0
        self.metrics: Optional[MetricsLog] = None  # fit's, while it runs: saves write their time there
        self.resumed_from, self.changes = None, []
        self.shards = self._shard_fingerprint()
        if candidates:
            self._resume(candidates)
        if env.is_main:
            record_launch(job.run_dir, job.to_json(), self.changes, self.resumed_from)
        self.startup.mark("ready")

    def _build_model(self, model: torch.nn.Module, towers) -> torch.nn.Module:
        """The sharded model with its initial weights, from the frozen meta-device model every rank
        built: decay groups and FLOPs taken on the original names, parallelized, then filled from rank 0.
        The last rank counts the FLOPs while rank 0 draws the initial weights."""
        job, env = self.job, self.env
        self.decay_groups = trainable_decay_groups(model, job.optimizer)
        self.shard_degree = self._shard_degree(model, towers)
        self.mesh = shard_mesh(env, self.shard_degree)
        if env.is_main:
            log.info("mesh: %d replica(s) × shard groups of %d", env.world_size // self.shard_degree, self.shard_degree)
        flops_rank = env.world_size - 1
        flops = [training_flops_per_sample(model) if env.rank == flops_rank else None]
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
        return model

    def _resolve_auto(self, model: torch.nn.Module, towers) -> FsdpSpec:
        """job.fsdp with its 'auto' compile and cuda_graph decided on rank 0 (parallelize.resolve_auto), the
        same on every rank; where towers are too large to compile whole, also from the work of one block's
        forward over a micro batch (the model's FLOPs spread over its blocks)."""
        job, env = self.job, self.env
        decided = [None]
        if env.is_main:
            blocks = max(1, sum(len(tower.blocks) for tower in towers.values()))
            block_flops = self.flops_per_sample / 3 * job.batch.per_gpu / blocks  # forward is a third of training
            decided[0] = resolve_auto(job.fsdp, model, towers, env.device.type, block_flops,
                                      world_size=env.world_size)
            fsdp = decided[0]
            if job.fsdp.compile == "auto":
                how = "off" if not fsdp.compile else "blocks" if fsdp.wrap == job.fsdp.wrap else \
                    f"whole towers ({fsdp.wrap.image[0]}, {fsdp.wrap.text[0]}; reshard_after_forward " \
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
            decided = [None]
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

    # ------------------------------------------------------------------ data
    def _batches(self, model: torch.nn.Module):
        """The rank's batches from the spec's data source (`spec.registry.DataSource`) for `model` (its shapes
        and preprocessing; the meta-device model will do); also sets `images` (what turns a micro batch's
        images into the model's input on the device, e.g. transform.TrainImages; None where they are that
        already)."""
        job, env = self.job, self.env
        self.data_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # see _next_batch
        rank = RankData(model, self.tokenizer, job.batch.per_gpu, env.rank, env.world_size, job.run.seed, env.device,
                        env.is_main)
        batches, self.images = DATA_SOURCES[job.data.source].batches(job.data, rank)
        return batches

    def _next_batch(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        """The next micro batch, on the device; `window.data_wait` gets how long the step waited for it.

        On CUDA that is the span on the training stream from just before the batch is asked for to the
        end of the work queued for it (host→device copies, decoding, cropping, normalisation): the
        device's time on the batch, and its idle time while the host fetched the batch and queued that
        work. Waiting for the workers while the device is still busy with earlier steps is no wait. CUDA
        events mark the span; they are read once the device has passed them, never waited for, so a span
        counts in the log window in which it is seen done. Elsewhere it is the host's time in here."""
        if self.env.device.type != "cuda":
            began = time.perf_counter()
            batch = self._fetch()
            window.data_wait += time.perf_counter() - began
            return batch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        batch = self._fetch()
        end.record()
        self.data_spans.append((start, end))
        while self.data_spans and self.data_spans[0][1].query():
            start, end = self.data_spans.popleft()
            window.data_wait += start.elapsed_time(end) / 1e3
        return batch

    def _fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, texts = next(self.batch_iter)
        self.startup.mark("first_batch")
        if self.images is not None:
            images = self.images(images)
        return images, texts.to(self.env.device, non_blocking=True)

    def close(self) -> None:
        """Stop the data workers (before the process exits, so none outlives it), then drop the step's CUDA
        graph (before the process group is destroyed: NCCL waits for graphs holding its collectives); a
        failure there is logged, not raised over the error that may be ending the run."""
        self.checkpointer.close()
        self.batch_iter.close()
        self.batches.close()
        forward_backward, self.forward_backward = getattr(self, "forward_backward", None), None
        if isinstance(forward_backward, GraphedForwardBackward):
            try:
                forward_backward.release()
            except Exception as exc:  # noqa: BLE001  (a device already broken by the failure being reported)
                log.warning("the step's CUDA graph was not released: %s", exc)

    # ------------------------------------------------------------------ step
    def train_step(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro batches; (the step's local loss, grad norm), on device."""
        accum = self.job.batch.grad_accum
        batches = [self._next_batch(window) for _ in range(accum)]
        loss = self.forward_backward(batches)
        average_replicated_gradients(self.replicated)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.trained, self.job.optimizer.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # on overflow the optimizer skips itself (found_inf), the scale halves
            self.scaler.update()
        else:
            found_inf = (~torch.isfinite(grad_norm)).float()  # the norm is global: every rank agrees
            if self.job.optimizer.on_nonfinite == "stop" and found_inf.item():
                last = latest_checkpoint(self.job.run_dir)
                raise Stop(EXIT_NONFINITE, f"gradient norm {grad_norm.item()} at step {self.step + 1}: stopped; "
                                           f"the last good checkpoint is {last or 'none (none was saved yet)'}")
            self.optimizer.step(found_inf=found_inf)  # a non-finite step is skipped on the device
            self.skipped_steps += found_inf
        self.scheduler.step()
        if not self.cuda_graph:  # a graphed step's gradients stay where its graph writes them
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        self.step += 1
        self.samples_seen += self.job.samples_per_step(self.env.world_size)
        window.steps += 1
        window.samples += self.job.batch.per_gpu * accum
        return loss, grad_norm

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The step's forward and backward (loss.backward_micro_batches) with the trainer's model, loss and
        loss scaler as they are at the call."""
        return backward_micro_batches(self.model, self.loss_fn, batches,
                                      self.scaler.scale if self.scaler is not None else None)

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        """Train to the end (or to a stop); returns the exit code."""
        job, env = self.job, self.env
        metrics = MetricsLog(job.run_dir, self.total_steps, job.logging.tensorboard, enabled=env.is_main,
                             wandb=job.logging.wandb, config=json.loads(job.to_json()))
        self.metrics = metrics
        window, window_loss = Window(), torch.zeros((), device=env.device)
        first_step_s, first_step_done = None, False
        if self.step >= self.total_steps:
            message = f"already finished: step {self.step} of {self.total_steps}, nothing to train"
            metrics.announce(message)
            metrics.close(EXIT_OK)
            self._report_exit(EXIT_OK, message)
            return EXIT_OK
        code = EXIT_CRASH  # unless the loop ends as planned
        self.stop_interval, self.checked = STOP_CHECK_STEPS, (self.step, time.perf_counter())
        first = self.step + 1  # a check after it sets the pace (its time includes the start-up's compiling)
        try:
            while self.step < self.total_steps:
                loss, grad_norm = self.train_step(window)
                window_loss += loss
                metrics.advance(self.step)
                if not first_step_done:
                    loss.item()  # wait for the device
                    first_step_s, first_step_done = time.time() - launch_time(), True
                    self.startup.mark("first_step")
                    metrics.announce(f"start-up, seconds since launch at the end of each phase (rank {env.rank}): "
                                     f"{self.startup.summary()}")
                    if self.compiled and env.is_main:
                        saved = save_compile_cache(job.run_dir / COMPILE_CACHE)
                        if saved:
                            log.info("compile cache: %d artifacts kept in %s", saved, job.run_dir / COMPILE_CACHE)
                last = self.step == self.total_steps
                if self.step % job.logging.every_steps == 0 or last:
                    record = self._log_record(window, window_loss, grad_norm)
                    if first_step_s is not None:
                        record["time_to_first_step_s"], first_step_s = first_step_s, None
                        record["startup_s"] = self.startup.phases
                    metrics.write(record)
                    window.reset()
                    window_loss.zero_()
                self.finish_saving(wait=False)
                if (self.step % self.stop_interval == 0 or self.step == first) and not last:
                    self._stop_if_asked()  # before an evaluation: a stop's checkpoint must not wait for one
                if job.eval.sets and ((job.eval.every_steps and self.step % job.eval.every_steps == 0 and not last)
                                      or (last and job.eval.at_end)):
                    self._evaluate_and_report(metrics)
                every = job.checkpoint.every_steps
                if every and self.step % every == 0 and not last:
                    self.save_due = self.save_due or self.step
                if self.save_due and not last:
                    self._save_due()
            if job.checkpoint.at_end:
                self.save()
            self.finish_saving(wait=True)
            self._report_exit(EXIT_OK, f"finished {self.step} steps")
            code = EXIT_OK
        except Stop as stop:
            self.finish_saving(wait=True)
            metrics.announce(stop.message, style="bold red")
            self._report_exit(stop.code, stop.message)
            code = stop.code
        finally:
            metrics.close(code)
        return code

    def _stop_if_asked(self) -> None:
        """Agree with the other ranks on a stop (a signal to any rank, a request file seen by rank 0, or a
        rank's launcher gone); if there is one, checkpoint and stop with EXIT_PREEMPTED. Otherwise set the
        interval to the next check from the slowest rank's step time since this one's last (the same on
        every rank)."""
        asked = self.signals.received if self.signals else 0
        if self.env.is_main and stop_requested(self.job.run_dir, launch_time()):
            asked = STOP_REQUEST
        if launcher_gone():
            asked = LAUNCHER_GONE
        now = time.perf_counter()
        step_ms = 1000 * (now - self.checked[1]) / max(1, self.step - self.checked[0])
        reason, slowest_ms, writes = all_max([asked, math.ceil(step_ms), self.checkpointer.write_status()],
                                             self.env.device)
        self.checked, self.stop_interval = (self.step, now), stop_check_interval(slowest_ms / 1000)
        self._raise_if_write_failed(writes)
        if not reason:
            return
        path = self.save()
        cause = {STOP_REQUEST: "a stop was requested", LAUNCHER_GONE: "the launcher (fsdpclip launch) has ended"}.get(
            reason) or f"{signal.Signals(reason).name} received"
        raise Stop(EXIT_PREEMPTED, f"{cause}: stopped after step {self.step}; checkpoint saved at {path}; start the "
                                   f"job again in {self.job.run_dir} to resume")

    def _log_record(self, window: Window, window_loss: torch.Tensor, grad_norm: torch.Tensor) -> dict:
        """The metrics of one log window (collectives: every rank calls it)."""
        env = self.env
        broken = self.batches.broken
        loss, = all_mean([window_loss.item() / max(1, window.steps)], env.device)
        broken_total, = all_sum([broken], env.device)
        logit_scale = self.model.logit_scale.exp().item()
        record = {"step": self.step, "total_steps": self.total_steps, "time": round(time.time(), 3),
                  "samples_seen": self.samples_seen, "loss": loss,
                  "lr": self.optimizer.param_groups[0]["lr"], "logit_scale": logit_scale,
                  "grad_norm": grad_norm.item(), "broken_samples": int(broken_total),
                  "skipped_steps": int(self.skipped_steps.item())}
        record.update(window.rates(env.world_size, self.flops_per_sample, self.peak))
        record["peak_memory_gib"] = peak_memory_gib(env.device)
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        return record

    def _evaluate_and_report(self, metrics: MetricsLog) -> None:
        results = self.evaluate()
        metrics.write({"step": self.step, **results})
        for key, values in results.items():
            metrics.announce(f"step {self.step} {result_line(key, values)}")

    def evaluate(self) -> dict[str, dict]:
        """Metrics per configured set, by 'zeroshot/NAME' or 'retrieval/NAME' (all ranks take part)."""
        if self.eval_sets is None:
            transform = image_transform(self.model, train=False)
            self.eval_sets = [load_eval_set(spec, transform) for spec in self.job.eval.sets]
        return {f"{s.kind}/{s.name}": evaluate_set(self.model, self.tokenizer, s, self.env.device,
                                                   self.job.eval.batch_per_gpu)
                for s in self.eval_sets}

    # ------------------------------------------------------------ checkpoints
    def _save_due(self) -> None:
        """Make the checkpoint that is due. An asynchronous one waits, while training goes on, for the write
        before it to end on every rank: saves then follow the disk's pace instead of stopping training."""
        job = self.job
        if job.checkpoint.async_save:
            writes, = all_max([self.checkpointer.write_status()], self.env.device)
            self._raise_if_write_failed(writes)
            if writes == WRITING:
                return
            if self.save_due != self.step and not self.late_saves and self.env.is_main:
                log.warning("the checkpoint due at step %d is saved at step %d: the write before it took longer than "
                            "checkpoint.every_steps (%d steps), and saves wait for it without stopping training",
                            self.save_due, self.step, job.checkpoint.every_steps)
            self.late_saves += self.save_due != self.step
        self.save(asynchronous=job.checkpoint.async_save)

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
        meta = {"samples_seen": self.samples_seen, "skipped_steps": int(self.skipped_steps.item()),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "model": {"label": self.job.model.label, "open_clip_config": self.model_config},
                "job": json.loads(self.job.to_json()), "shards": self.shards}
        rank_state = {"rng": rng_state(self.env.device), "data": self.batches.state_dict()}
        began = time.perf_counter()
        with self._stop_when_save_fails():
            path = self.checkpointer.save(self.step, self.model, self.optimizer, meta, rank_state, asynchronous)
        self.last_saved = self.step
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

    def finish_saving(self, wait: bool) -> None:
        """Publish an asynchronous save whose writes are done (or wait for them: `Checkpointer.finish_pending`)."""
        with self._stop_when_save_fails():
            self.checkpointer.finish_pending(wait)

    @contextlib.contextmanager
    def _stop_when_save_fails(self):
        """A checkpoint that could not be written as a Stop naming the one kept: exit 74 when it did not fit on
        its disk (DiskFull), else EXIT_CRASH."""
        try:
            yield
        except CheckpointError as exc:
            latest = latest_checkpoint(self.job.run_dir)
            full = isinstance(exc, DiskFull)
            raise Stop(EXIT_NO_SPACE if full else EXIT_CRASH,
                       f"{exc}; the last complete checkpoint, {latest.name if latest else 'none'}, is kept: "
                       f"{'make room and ' if full else ''}launch again to resume from it") from None

    def _resume(self, candidates: list[Path]) -> None:
        """Continue from the newest candidate that loads, with this spec's settings from its step on."""
        for checkpoint in candidates:
            try:
                meta, rank_state = self.checkpointer.load(checkpoint, self.model, self.optimizer)
                break
            except CheckpointError as exc:
                log.warning("%s: trying the checkpoint before it", exc)
        else:
            raise CheckpointError(f"none of {', '.join(str(c) for c in candidates)} could be loaded")
        changes = checkpoint_changes(meta, self.job, self.model_config, lambda: self.shards)
        fixed = [str(c) for c in changes if is_fixed(c)]
        if fixed:
            raise CheckpointError(f"{checkpoint} was trained with another model or optimizer layout "
                                  f"({'; '.join(fixed)}): resume it with its own, or start a new run")
        self.resumed_from, self.changes = str(checkpoint), [str(c) for c in changes]
        self.step, self.samples_seen, self.last_saved = meta["step"], meta["samples_seen"], meta["step"]
        self.skipped_steps.fill_(meta["skipped_steps"])
        self._apply_spec(meta)
        if rank_state is not None and keeps_data_position(changes):
            set_rng_state(rank_state["rng"], self.env.device)
            self.batches.load_state_dict(rank_state["data"])
        else:
            why = "data or batch changed" if rank_state is not None else \
                f"imported from {meta['imported']['source']}" if "imported" in meta else \
                f"saved by {meta['world_size']} ranks, this run has {self.env.world_size}"
            log.warning("%s: the data stream restarts at its epoch (%s)", checkpoint, why)
            epoch_samples = self.job.epoch_samples(self.env.world_size)
            self.batches.restart(self.step * self.job.batch.grad_accum,
                                 self.samples_seen // epoch_samples if epoch_samples else 0)
        for change in self.changes:
            log.warning("changed since %s: %s (applied from step %d)", checkpoint.name, change, self.step)
        log.info("resumed from %s at step %d", checkpoint, self.step)

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
        self.total_steps = job.total_steps(self.env.world_size, self.step, self.samples_seen)
        self.scheduler = Schedule(self.optimizer, job.schedule, job.optimizer.lr, self.total_steps)
        self.scheduler.set_step(self.step)
        if self.scaler is not None and meta["scaler"] is not None:
            self.scaler.load_state_dict(meta["scaler"])

    def _report_exit(self, code: int, message: str) -> None:
        """Rank 0 writes exit.json; every rank waits for it, so that none ends (and has torchrun stop the
        others) before the report is written."""
        if self.env.is_main:
            write_exit_report(self.job.run_dir, code, message, self.step, str(latest_checkpoint(self.job.run_dir) or ""))
        dist.barrier()


def stop_check_interval(step_seconds: float) -> int:
    """Steps between two stop checks for steps of `step_seconds`: the most of 10, 5, 2 and 1 that keeps
    them STOP_CHECK_SECONDS apart (1 for steps longer than 5 s). Divisors of STOP_CHECK_STEPS, so that
    steps of up to a second are checked at its multiples."""
    return next((n for n in (STOP_CHECK_STEPS, 5, 2) if n * step_seconds <= STOP_CHECK_SECONDS), 1)


@contextlib.contextmanager
def run_lock(job: Job, env: Dist):
    """Hold the run directory's lock (rank 0 takes it, or finds its launch holding it) while the job
    runs; every rank learns the outcome, and all stop (Stop, exit 2) when another job holds it."""
    lock, refused = HeldLock(job.run_dir, lock_token()), [None]
    if env.is_main:
        try:
            lock.__enter__()
        except RunLocked as exc:
            refused[0] = str(exc)
    dist.broadcast_object_list(refused, src=0)
    if refused[0] is not None:
        raise Stop(EXIT_SPEC, refused[0])
    try:
        yield
    finally:
        if env.is_main:
            lock.__exit__(None, None, None)
