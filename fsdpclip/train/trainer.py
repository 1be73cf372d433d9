"""One rank's training: the Trainer (model, data, optimizer, checkpoints, evaluation) and its loop. Its parts
live beside it: the model's set-up (`building`), the data (`feeding`), checkpoints (`saving`), evaluation
(`evaluating`) and stops (`stops`).

Started by fsdpclip.train.entry, the rank entry point, which imports this module on a thread while the
process group forms; its exit codes are listed there.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Optional

import torch

from fsdpclip.checkpoint.layout import latest_checkpoint
from fsdpclip.checkpoint.sharded import Checkpointer
from fsdpclip.checkpoint.staging import host_copy_bytes
from fsdpclip.model.build import build_tokenizer, training_config
from fsdpclip.model.trainable import frozen_meta_model
from fsdpclip.parallel.cuda_graphs import GraphedForwardBackward
from fsdpclip.parallel.distributed import Dist, all_mean, all_sum
from fsdpclip.parallel.float8 import precompute_float8_scales
from fsdpclip.parallel.parallelize import average_replicated_gradients, replicated_parameters
from fsdpclip.run.directory import EXIT_CRASH, EXIT_NONFINITE, EXIT_OK
from fsdpclip.run.lock import StartupClock, launch_time, launcher_reports
from fsdpclip.run.reports import record_launch
from fsdpclip.spec.job import Job
from fsdpclip.train.loss import backward_micro_batches, build_loss
from fsdpclip.train.metrics import MetricsLog, Window, peak_memory_gib, peak_tflops
from fsdpclip.train.optim import Schedule, build_grad_scaler, build_optimizer, clip_gradients

from fsdpclip.train.building import ModelBuilding
from fsdpclip.train.evaluating import Evaluation
from fsdpclip.train.feeding import DataFeed
from fsdpclip.train.saving import Checkpointing
from fsdpclip.train.sizing import BatchSizing
from fsdpclip.train.stops import STOP_CHECK_STEPS, Stop, StopChecks

log = logging.getLogger("fsdpclip")
LOGIT_SCALE_MAX = math.log(100)  # OpenCLIP clamps the learned temperature to at most 100


class Trainer(ModelBuilding, BatchSizing, DataFeed, Checkpointing, Evaluation, StopChecks):
    """One rank's share of a sharded training run, built from the job spec."""

    def __init__(self, job: Job, env: Dist, signals=None, startup: Optional[StartupClock] = None):
        """`signals`: what tells the loop a stop signal came (fsdpclip.train.entry.StopSignals: `received`)."""
        self.job, self.env, self.signals = job, env, signals
        self.startup = startup or StartupClock()
        self.model_config = training_config(job)
        self.checkpointer = Checkpointer(job.run_dir, job.checkpoint, env.rank, env.world_size)
        candidates = self.checkpointer.resume_candidates()
        meta_model, towers = frozen_meta_model(self.model_config, job)
        self.startup.mark("meta_model")
        self.tokenizer = build_tokenizer(self.model_config)
        self.batches, self.batch_iter, self.batch_search, self.waiting_hints = None, None, None, []
        self.plan = self._plan(meta_model, towers)
        if not job.batch.searched:  # else the batch is known once the model is built (train.sizing)
            self._open_batches(meta_model, start=not candidates)
        try:
            self._set_up(meta_model, towers, candidates)
        except BaseException:  # the data workers ignore stop signals: none may outlive a start that failed
            self.close()
            raise

    def _set_up(self, meta_model: torch.nn.Module, towers, candidates: list[Path]) -> None:
        """Everything after the data: the sharded model, optimizer, schedule, scaler and loss, then the
        resumed state."""
        self.model = self._build_model(meta_model, towers)
        if self.job.batch.searched:
            self._settle_batch()
            # the spec checkpoints keep, resumes compare and the run's length counts with: the batch trained
            self.job = self.job.with_batch(self.plan.per_gpu, self.plan.grad_accum)
            self._open_batches(self.model, start=not candidates)
        job, env = self.job, self.env
        self.startup.mark("model")
        torch.manual_seed(job.run.seed + 1 + env.rank)  # dropout differs between ranks
        self.total_steps = job.length(env.world_size)
        self.optimizer = build_optimizer(self.model, self.decay_groups, job.optimizer)
        self.scheduler = Schedule(self.optimizer, job.schedule, job.optimizer.lr, self.total_steps)
        # The trained parameters, and those every rank holds whole, listed once (not walked each step).
        self.trained = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.replicated = [p for p in replicated_parameters(self.model) if p.requires_grad]
        self.async_saves = self._asynchronous_saves(host_copy_bytes(self.model, self.trained), towers)
        self.scaler = build_grad_scaler(job.fsdp, env.device) if self.plan.grad_scaler else None
        self.loss_fn = build_loss(job.loss, env.rank, env.world_size)
        self.forward_backward = GraphedForwardBackward(self._forward_backward, self.trained) if self.plan.cuda_graph \
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
        self.counted: tuple[int, dict[str, int]] = (0, {})  # samples counted before a resume that restarted the data
        self.shards = self._shard_fingerprint()
        if candidates:
            self._resume(candidates)
        if env.is_main:
            record_launch(job.run_dir, job.to_json(), self.changes, self.resumed_from)
            self.plan.save(job.run_dir)
        self.startup.mark("ready")

    def close(self) -> None:
        """Stop the data workers (before the process exits, so none outlives it), then drop the step's CUDA
        graph (before the process group is destroyed: NCCL waits for graphs holding its collectives); a
        failure there is logged, not raised over the error that may be ending the run."""
        self.checkpointer.close()
        self._close_batches()
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
        assert self.forward_backward is not None  # until close()
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
        if self.float8_scales:
            precompute_float8_scales(self.model)
        if not self.plan.cuda_graph:  # a graphed step's gradients stay where its graph writes them
            self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        self.step += 1
        self.samples_seen += self.job.samples_per_step(self.env.world_size)
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
        job, env = self.job, self.env
        metrics = MetricsLog(job.run_dir, self.total_steps, job.logging.tensorboard, enabled=env.is_main,
                             wandb=job.logging.wandb, config=json.loads(job.to_json()), data_hints=self.waiting_hints)
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
        self.saved_at = time.monotonic()  # checkpoint.every_minutes count from here, then from each save
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
                    if self.plan.layout.compile and env.is_main:
                        self._keep_compile_cache()
                last = self.step == self.total_steps
                if self.step % job.logging.every_steps == 0 or last:
                    record = self._log_record(window, window_loss, grad_norm)
                    if first_step_s is not None:
                        record["time_to_first_step_s"], first_step_s = first_step_s, None
                        record["startup_s"] = self.startup.phases
                        if self.batch_search is not None:
                            record["auto_batch"] = self.batch_search
                    metrics.write(record)
                    self._judge_supply(window)
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
            not_uploaded = self.finish_saving(wait=True)
            self._report_exit(EXIT_OK, f"finished {self.step} steps{not_uploaded}")
            code = EXIT_OK
        except Stop as stop:
            message = stop.message + self.finish_saving(wait=True)
            if not launcher_reports():
                metrics.announce(message, style="bold red")
            self._report_exit(stop.code, message)
            code = stop.code
        finally:
            metrics.close(code)
        return code


    def _log_record(self, window: Window, window_loss: torch.Tensor, grad_norm: torch.Tensor) -> dict:
        """The metrics of one log window (collectives: every rank calls it)."""
        env = self.env
        loss, = all_mean([window_loss.item() / max(1, window.steps)], env.device)
        broken, by_source = self._sample_counts()
        logit_scale = self.model.logit_scale.exp().item()
        record = {"step": self.step, "total_steps": self.total_steps, "time": round(time.time(), 3),
                  "samples_seen": self.samples_seen, "loss": loss,
                  "lr": self.scheduler.lr_of(self.step - 1), "logit_scale": logit_scale,
                  "grad_norm": grad_norm.item(), "broken_samples": broken,
                  "skipped_steps": int(self.skipped_steps.item())}
        if by_source:
            record["source_samples"] = by_source
        if (share := getattr(self.batches, "jpeg_engine_share", None)) is not None:
            record["jpeg_engine_share"] = round(share, 3)  # this rank's
        record.update(window.rates(env.world_size, self.flops_per_sample, self.peak))
        record["peak_memory_gib"] = peak_memory_gib(env.device)
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        return record

    def _sample_counts(self) -> tuple[int, dict[str, int]]:
        """Broken samples skipped and a mixture's samples by source so far, over all ranks (collectives: every rank
        calls it), with those counted before a resume whose data started again (`counted`)."""
        by_source = getattr(self.batches, "source_samples", {})
        broken, *totals = all_sum([self.batches.broken, *by_source.values()], self.env.device)
        broken_before, sources_before = self.counted
        return int(broken) + broken_before, {name: int(total) + sources_before.get(name, 0)
                                             for name, total in zip(by_source, totals)}
