"""One rank's training: the Trainer and its loop. It holds its parts, each built once and handed what it needs:
the run plan and the sharded model (`building`), the batch of per_gpu 'auto' (`sizing`), the data (`feeding`),
checkpoints (`saving`), evaluation (`evaluating`) and stops (`stops`).

Started by fsdpclip.launch.entry, the rank entry point, which imports this module on a thread while the
process group forms; its exit codes are listed there.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from fsdpclip.checkpoint.layout import latest_checkpoint
from fsdpclip.checkpoint.sharded import Checkpointer
from fsdpclip.checkpoint.staging import host_copy_bytes
from fsdpclip.model.build import OpenClip, build_tokenizer, training_config
from fsdpclip.model.trainable import frozen_meta_model
from fsdpclip.parallel.cuda_graphs import GraphedForwardBackward
from fsdpclip.parallel.distributed import Dist, all_mean
from fsdpclip.model.float8 import precompute_float8_scales
from fsdpclip.parallel.parallelize import average_replicated_gradients, replicated_parameters
from fsdpclip.run.directory import EXIT_CRASH, EXIT_NONFINITE, EXIT_OK
from fsdpclip.run.lock import StartupClock, launch_time, launcher_reports
from fsdpclip.run.reports import record_launch
from fsdpclip.jobspec.job import Job
from fsdpclip.optim.ema import moving_average
from fsdpclip.train.loss import backward_micro_batches, build_loss
from fsdpclip.train.metrics import MetricsLog, Window, peak_memory_gib, peak_tflops
from fsdpclip.optim.adamw import Schedule, build_grad_scaler, build_optimizer, clip_gradients

from fsdpclip.train.building import BuiltModel, build_model, keep_compile_cache, plan_run
from fsdpclip.train.evaluating import Evaluator
from fsdpclip.train.feeding import DataFeed
from fsdpclip.train.saving import CheckpointManager, Progress, TrainingState, settle_async_saves
from fsdpclip.train.sizing import BatchSizing
from fsdpclip.train.stops import Stop, StopChecks, report_exit

log = logging.getLogger("fsdpclip")
LOGIT_SCALE_MAX = math.log(100)  # OpenCLIP clamps the learned temperature to at most 100


class Trainer:
    """One rank's share of a sharded training run, built from the job spec."""

    def __init__(self, job: Job, env: Dist, signals=None, startup: Optional[StartupClock] = None):
        """`signals`: what tells the loop a stop signal came (fsdpclip.launch.entry.StopSignals: `received`)."""
        self.job, self.env, self.signals = job, env, signals
        self.startup = startup or StartupClock()
        self.model_config = training_config(job)
        self.checkpointer = Checkpointer(job.run_dir, job.checkpoint, env.rank, env.world_size)
        candidates = self.checkpointer.resume_candidates()
        meta_model, towers = frozen_meta_model(self.model_config, job)
        self.startup.mark("meta_model")
        self.tokenizer = build_tokenizer(self.model_config)
        self.feed: Optional[DataFeed] = None
        self.forward_backward: Optional[Callable[[list], torch.Tensor]] = None
        sizing = BatchSizing(job, env)
        self.plan = plan_run(job, env, meta_model, towers, sizing.recorded)
        if not job.batch.searched:  # else the batch is known once the model is built (train.sizing)
            self.feed = self._open_feed(meta_model, start=not candidates)
        try:
            self._set_up(meta_model, towers, candidates, sizing)
        except BaseException:  # the data workers ignore stop signals: none may outlive a start that failed
            self.close()
            raise

    def _set_up(self, meta_model: torch.nn.Module, towers, candidates: list[Path], sizing: BatchSizing) -> None:
        """Everything after the data: the sharded model, optimizer, scaler, loss, evaluation and checkpoints, then
        the resumed state, and the schedule over the run's length."""
        self.built: BuiltModel = build_model(self.job, self.env, self.plan, meta_model, towers, self.startup)
        self.plan, self.batch_report = self.built.plan, None
        # the average's float32 shards are held through every step: the batch search below finds them taken
        self.ema = moving_average(self.built.model, self.job.moving_average)
        if self.job.batch.searched:
            settled = sizing.settle(self.built)
            self.startup.mark("batch_search")
            self.plan, self.batch_report = settled.plan, settled.report
            # the spec checkpoints keep, resumes compare and the run's length counts with: the batch trained
            self.job = self.job.with_batch(self.plan.per_gpu, self.plan.grad_accum)
            self.feed = self._open_feed(self.model, start=not candidates)
        assert self.feed is not None  # opened above, or before the model was built
        job, env, model = self.job, self.env, self.model
        self.startup.mark("model")
        torch.manual_seed(job.run.seed + 1 + env.rank)  # dropout differs between ranks
        self.optimizer = build_optimizer(model, self.built.decay_groups, job.optimizer)
        # The trained parameters, and those every rank holds whole, listed once (not walked each step).
        self.trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.replicated = [p for p in replicated_parameters(model) if p.requires_grad]
        self.plan = settle_async_saves(job, env, self.plan, towers, self.checkpointer,
                                       host_copy_bytes(model, self.trained,
                                                       self.ema.state_dict() if self.ema is not None else None))
        self.scaler = build_grad_scaler(job.fsdp, env.device) if self.plan.grad_scaler else None
        self.loss_fn = build_loss(job.loss, env.rank, env.world_size)
        self.forward_backward = GraphedForwardBackward(self._forward_backward, self.trained) if self.plan.cuda_graph \
            else self._forward_backward
        self.evaluator = Evaluator(model, self.tokenizer, job.eval, env.device, self.ema if job.eval.ema else None)
        self.progress = Progress(torch.zeros((), device=env.device))  # non-finite steps skipped: on the device
        self.peak = peak_tflops(env.device, job.logging.peak_tflops)
        state = TrainingState(model, self.optimizer, self.scaler, self.progress, self.feed, self.ema)
        self.checkpoints = CheckpointManager(job, env, self.checkpointer, state, self.model_config,
                                             self.plan.async_save)
        resumed_from, changes = None, []
        if candidates:
            resumed_from, changes = self.checkpoints.resume(candidates)
            self._apply_optimizer_spec()
        progress = self.progress  # the length in samples for epochs, from a resumed run's step on
        self.total_steps = job.length(env.world_size, progress.step, progress.samples_seen, self.feed.data_ranks)
        self.scheduler = Schedule(self.optimizer, job.schedule, job.optimizer.lr, self.total_steps)
        self.scheduler.set_step(progress.step)
        if env.is_main:
            record_launch(job.run_dir, job.to_json(), changes, resumed_from)
            self.plan.save(job.run_dir)
        self.startup.mark("ready")

    def _open_feed(self, model: torch.nn.Module, start: bool) -> DataFeed:
        """The data for `model`, its workers started where `start`."""
        return DataFeed(self.job, self.env, model, self.tokenizer, self.plan.data, self.startup, start)

    def _apply_optimizer_spec(self) -> None:
        """This spec's AdamW settings on the resumed optimizer (a checkpoint carries state, never settings)."""
        spec = self.job.optimizer
        for group, decay in zip(self.optimizer.param_groups, self.built.decay_groups):
            group.update(betas=spec.betas, eps=spec.eps, weight_decay=decay.weight_decay)

    @property
    def model(self) -> OpenClip:
        """The sharded model."""
        return self.built.model

    def close(self) -> None:
        """Stop the data workers (before the process exits, so none outlives it), then drop the step's CUDA
        graph (before the process group is destroyed: NCCL waits for graphs holding its collectives); a
        failure there is logged, not raised over the error that may be ending the run."""
        self.checkpointer.close()
        if self.feed is not None:
            self.feed.close()
        forward_backward, self.forward_backward = self.forward_backward, None
        if isinstance(forward_backward, GraphedForwardBackward):
            try:
                forward_backward.release()
            except Exception as exc:  # noqa: BLE001  (a device already broken by the failure being reported)
                log.warning("the step's CUDA graph was not released: %s", exc)

    # ------------------------------------------------------------------ step
    def train_step(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro batches; (the step's local loss, grad norm), on device."""
        assert self.feed is not None and self.forward_backward is not None  # until close()
        accum = self.job.batch.grad_accum
        batches = [self.feed.next_batch(window) for _ in range(accum)]
        loss = self.forward_backward(batches)
        average_replicated_gradients(self.replicated)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.trained, self.job.optimizer.grad_clip_norm)
        found_inf = None
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # on overflow the optimizer skips itself (found_inf), the scale halves
            self.scaler.update()
        else:
            found_inf = (~torch.isfinite(grad_norm)).float()  # the norm is global: every rank agrees
            if self.job.optimizer.on_nonfinite == "stop" and found_inf.item():
                last = latest_checkpoint(self.job.run_dir) or "none (none was saved yet)"
                raise Stop(EXIT_NONFINITE, f"gradient norm {grad_norm.item()} at step {self.progress.step + 1}: "
                                           f"stopped; the last good checkpoint is {last}")
            self.optimizer.step(found_inf=found_inf)  # a non-finite step is skipped on the device
        self.scheduler.step()
        if self.built.float8_scales:
            precompute_float8_scales(self.model)
        if not self.plan.cuda_graph:  # a graphed step's gradients stay where its graph writes them
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        self.progress.advance(self.job.samples_per_step(self.env.world_size), skipped=found_inf)
        if self.ema is not None:
            self.ema.update(self.progress.step, self.optimizer.skipped)
        window.steps += 1
        window.samples += self.job.batch.settled_per_gpu * accum
        return loss, grad_norm

    def _forward_backward(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The step's forward and backward (loss.backward_micro_batches) with the trainer's model, loss and
        loss scaler as they are at the call."""
        return backward_micro_batches(self.model, self.loss_fn, batches,
                                      self.scaler.scale if self.scaler is not None else None)

    # ------------------------------------------------------------------ loop
    def fit(self) -> int:
        """Train to the end (or to a stop); returns the exit code."""
        assert self.feed is not None  # until close()
        job, env, progress = self.job, self.env, self.progress
        metrics = MetricsLog(job.run_dir, self.total_steps, job.logging.tensorboard, enabled=env.is_main,
                             wandb=job.logging.wandb, config=json.loads(job.to_json()),
                             data_hints=self.feed.waiting_hints)
        self.checkpoints.start(metrics)  # saves write their time there; checkpoint.every_minutes count from now
        window, window_loss = Window(), torch.zeros((), device=env.device)
        first_step_s, first_step_done = None, False
        if progress.step >= self.total_steps:
            message = f"already finished: step {progress.step} of {self.total_steps}, nothing to train"
            metrics.announce(message)
            metrics.close(EXIT_OK)
            report_exit(job, env, EXIT_OK, message, progress.step)
            return EXIT_OK
        code = EXIT_CRASH  # unless the loop ends as planned
        stops = StopChecks(job, env, self.signals, self.checkpoints, progress.step)
        try:
            while progress.step < self.total_steps:
                loss, grad_norm = self.train_step(window)
                window_loss += loss
                metrics.advance(progress.step)
                if not first_step_done:
                    loss.item()  # wait for the device
                    first_step_s, first_step_done = time.time() - launch_time(), True
                    self.startup.mark("first_step")
                    metrics.announce(f"start-up, seconds since launch at the end of each phase (rank {env.rank}): "
                                     f"{self.startup.summary()}")
                    if self.plan.layout.compile and env.is_main:
                        keep_compile_cache(job)
                last = progress.step == self.total_steps
                if progress.step % job.logging.every_steps == 0 or last:
                    record = self._log_record(window, window_loss, grad_norm)
                    if first_step_s is not None:
                        record["time_to_first_step_s"], first_step_s = first_step_s, None
                        record["startup_s"] = self.startup.phases
                        if self.batch_report is not None:
                            record["auto_batch"] = self.batch_report
                    metrics.write(record)
                    self.feed.judge_supply(window)
                    window.reset()
                    window_loss.zero_()
                self.checkpoints.finish_saving(wait=False)
                if stops.due(progress.step) and not last:
                    stops.check(progress.step)  # before an evaluation: a stop's checkpoint must not wait for one
                if self.evaluator.due(progress.step, last):
                    self.evaluator.report(metrics, progress.step)
                if not last:
                    self.checkpoints.save_if_due()
            if job.checkpoint.at_end:
                self.checkpoints.save()
            not_uploaded = self.checkpoints.finish_saving(wait=True)
            report_exit(job, env, EXIT_OK, f"finished {progress.step} steps{not_uploaded}", progress.step)
            code = EXIT_OK
        except Stop as stop:
            message = stop.message + self.checkpoints.finish_saving(wait=True)
            if not launcher_reports():
                metrics.announce(message, style="bold red")
            report_exit(job, env, stop.code, message, progress.step)
            code = stop.code
        finally:
            metrics.close(code)
        return code

    def _log_record(self, window: Window, window_loss: torch.Tensor, grad_norm: torch.Tensor) -> dict[str, Any]:
        """The metrics of one log window (collectives: every rank calls it)."""
        assert self.feed is not None  # until close()
        env, progress = self.env, self.progress
        loss, = all_mean([window_loss.item() / max(1, window.steps)], env.device)
        broken, by_source = self.feed.sample_counts()
        logit_scale = self.model.logit_scale.exp().item()
        record: dict[str, Any] = {
            "step": progress.step, "total_steps": self.total_steps, "time": round(time.time(), 3),
            "samples_seen": progress.samples_seen, "loss": loss,
            "lr": self.scheduler.lr_of(progress.step - 1), "logit_scale": logit_scale,
            "grad_norm": grad_norm.item(), "broken_samples": broken,
            "skipped_steps": int(progress.skipped_steps.item())}
        if by_source:
            record["source_samples"] = by_source
        if (share := self.feed.jpeg_engine_share) is not None:
            record["jpeg_engine_share"] = round(share, 3)  # this rank's
        record.update(window.rates(env.world_size, self.built.flops_per_sample, self.peak))
        record["peak_memory_gib"] = peak_memory_gib(env.device)
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        return record
