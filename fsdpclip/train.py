"""The rank entry point (what torchrun starts on every rank) and the training loop.

    python -m fsdpclip.train RUN_DIR/job.json      (or: fsdpclip train RUN_DIR/job.json)
"""

from __future__ import annotations

import logging
import math
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from fsdpclip.data import ShardStream, SyntheticBatches, WebDatasetBatches
from fsdpclip.distributed import Dist, all_mean, all_sum, init_distributed
from fsdpclip.evaluate import ZeroShotSet, load_zeroshot_set, zeroshot_metrics
from fsdpclip.metrics import (
    MetricsLog, Window, launch_time, peak_memory_gib, peak_tflops, training_flops_per_sample,
)
from fsdpclip.model import (
    apply_freeze, build_model, build_tokenizer, decay_groups, find_towers, frozen_names, image_shape,
    image_transform, initial_model, original_shapes, text_shape,
)
from fsdpclip.optim import build_grad_scaler, build_optimizer, build_scheduler, clip_gradients
from fsdpclip.shard import apply_activation_checkpointing, apply_compile, apply_fsdp, materialize, plan_units
from fsdpclip.spec import TOWERS, Job, LossSpec, SyntheticSpec

log = logging.getLogger("fsdpclip")
LOGIT_SCALE_MAX = math.log(100)  # OpenCLIP clamps the learned temperature to at most 100


def run_dir_of(job: Job) -> Path:
    return Path(job.run.output_dir) / job.run.name


def total_steps(job: Job, world_size: int) -> int:
    """Optimizer steps of the whole run (the spec's steps, or epochs of data.samples)."""
    if job.schedule.steps is not None:
        return job.schedule.steps
    global_batch = job.batch.per_gpu * job.batch.grad_accum * world_size
    return (job.data.samples // global_batch) * (job.schedule.epochs or 1)


def build_loss(spec: LossSpec, rank: int, world_size: int) -> torch.nn.Module:
    """OpenCLIP's CLIP or SigLIP loss over the global batch."""
    from open_clip.loss import ClipLoss, SigLipLoss

    if spec.kind == "siglip":
        return SigLipLoss(rank=rank, world_size=world_size, dist_impl=spec.exchange)
    return ClipLoss(local_loss=spec.local_loss, gather_with_grad=spec.gather_with_grad, cache_labels=True,
                    rank=rank, world_size=world_size)


class Trainer:
    """One rank's share of a sharded training run, built from the job spec."""

    def __init__(self, job: Job, env: Dist, run_dir: Path):
        self.job, self.env, self.run_dir = job, env, run_dir
        fsdp = job.fsdp
        model = build_model(job.model, device="meta")
        towers = find_towers(model, job.model)
        apply_freeze(model, frozen_names(towers, job.freeze))
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        shapes = {n: s for n, s in original_shapes(model).items() if n in trainable}
        self.decay_groups = decay_groups(shapes, job.optimizer.decay_rules, job.optimizer.weight_decay)
        self.flops_per_sample = training_flops_per_sample(model) if env.is_main else 0.0
        source = initial_model(job.model, job.run.seed) if env.is_main else None
        apply_activation_checkpointing(model, {t: getattr(fsdp.activation_checkpointing, t) for t in TOWERS})
        units = plan_units(model, towers, fsdp)
        if fsdp.compile:
            apply_compile(model, units)
        apply_fsdp(model, units, fsdp, env.mesh, env.device)
        materialize(model, env.device, fsdp.cpu_offload, source)
        del source
        torch.manual_seed(job.run.seed + 1 + env.rank)  # dropout and augmentation differ between ranks
        self.model = model
        self.total_steps = total_steps(job, env.world_size)
        self.optimizer = build_optimizer(model, self.decay_groups, job.optimizer)
        self.scheduler = build_scheduler(self.optimizer, job.schedule, job.optimizer.lr, self.total_steps)
        self.scaler = build_grad_scaler(fsdp, env.device)
        self.loss_fn = build_loss(job.loss, env.rank, env.world_size)
        self.tokenizer = build_tokenizer(job.model)
        self.batches = self._batches()
        self.batch_iter: Iterator = iter(self.batches)
        self.zeroshot_sets: Optional[list[ZeroShotSet]] = None
        self.step = self.samples_seen = 0
        self.peak = peak_tflops(env.device, job.logging.peak_tflops)

    # ------------------------------------------------------------------ data
    def _batches(self):
        job, env, model = self.job, self.env, self.model
        if isinstance(job.data, SyntheticSpec):
            context, vocab = text_shape(model)
            return SyntheticBatches(image_shape(model), context, vocab, job.batch.per_gpu, env.device,
                                    job.run.seed, env.rank)
        stream = ShardStream(job.data, image_transform(model, train=True), build_tokenizer(job.model),
                             job.batch.per_gpu, env.rank, env.world_size, job.run.seed)
        return WebDatasetBatches(stream, job.data.workers, pin_memory=env.device.type == "cuda")

    def _next_batch(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        start = time.perf_counter()
        images, texts = next(self.batch_iter)
        images = images.to(self.env.device, non_blocking=True)
        texts = texts.to(self.env.device, non_blocking=True)
        window.data_wait += time.perf_counter() - start
        return images, texts

    # ------------------------------------------------------------------ step
    def train_step(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over grad_accum micro batches; (mean local loss, grad norm), on device."""
        accum = self.job.batch.grad_accum
        loss_sum = torch.zeros((), device=self.env.device)
        for _ in range(accum):
            images, texts = self._next_batch(window)
            loss = self.loss_fn(*self.model(images, texts)) / accum
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = clip_gradients(self.model, self.job.optimizer.grad_clip_norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, LOGIT_SCALE_MAX)
        self.step += 1
        self.samples_seen += self.job.batch.per_gpu * accum * self.env.world_size
        window.steps += 1
        window.samples += self.job.batch.per_gpu * accum
        return loss_sum, grad_norm

    # ------------------------------------------------------------------ loop
    def fit(self) -> None:
        job, env = self.job, self.env
        metrics = MetricsLog(self.run_dir, self.total_steps, job.logging.tensorboard, enabled=env.is_main)
        window, window_loss = Window(), torch.zeros((), device=env.device)
        first_step_s, first_step_done = None, False
        try:
            while self.step < self.total_steps:
                loss, grad_norm = self.train_step(window)
                window_loss += loss
                if not first_step_done:
                    loss.item()  # wait for the device
                    first_step_s, first_step_done = time.time() - launch_time(), True
                last = self.step == self.total_steps
                if self.step % job.logging.every_steps == 0 or last:
                    record = self._log_record(window, window_loss, grad_norm)
                    if first_step_s is not None:
                        record["time_to_first_step_s"], first_step_s = first_step_s, None
                    metrics.write(record)
                    window.reset()
                    window_loss.zero_()
                if job.eval.zeroshot and ((job.eval.every_steps and self.step % job.eval.every_steps == 0 and not last)
                                          or (last and job.eval.at_end)):
                    results = self.evaluate()
                    metrics.write({"step": self.step, **{f"zeroshot/{k}": v for k, v in results.items()}})
                    for name, values in results.items():
                        metrics.announce(f"step {self.step} zero-shot {name}: acc1 {values['acc1']:.3f}, "
                                         f"acc5 {values['acc5']:.3f}, mean per-class recall "
                                         f"{values['mean_per_class_recall']:.3f} ({values['samples']} images)")
        finally:
            metrics.close()

    def _log_record(self, window: Window, window_loss: torch.Tensor, grad_norm: torch.Tensor) -> dict:
        """The metrics of one log window (collectives: every rank calls it)."""
        env = self.env
        broken = getattr(getattr(self.batches, "position", None), "broken", 0)
        loss, = all_mean([window_loss.item() / max(1, window.steps)], env.device)
        broken_total, = all_sum([broken], env.device)
        logit_scale = self.model.logit_scale.full_tensor().exp().item()
        record = {"step": self.step, "samples_seen": self.samples_seen, "loss": loss,
                  "lr": self.optimizer.param_groups[0]["lr"], "logit_scale": logit_scale,
                  "grad_norm": grad_norm.item(), "broken_samples": int(broken_total)}
        record.update(window.rates(env.world_size, self.flops_per_sample, self.peak))
        record["peak_memory_gib"] = peak_memory_gib(env.device)
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
        return record

    def evaluate(self) -> dict[str, dict]:
        """Zero-shot metrics per configured set, by set name (all ranks take part)."""
        if self.zeroshot_sets is None:
            transform = image_transform(self.model, train=False)
            self.zeroshot_sets = [load_zeroshot_set(spec, transform) for spec in self.job.eval.zeroshot]
        return {zs.name: zeroshot_metrics(self.model, self.tokenizer, zs, self.env.device,
                                                         self.job.eval.batch_per_gpu)
                for zs in self.zeroshot_sets}


def main(argv: Optional[list[str]] = None) -> int:
    """Train from a job file on this rank (torchrun sets RANK, WORLD_SIZE and the rendezvous)."""
    import argparse

    from fsdpclip.problems import SpecError
    from fsdpclip.spec import load_job

    parser = argparse.ArgumentParser(prog="fsdpclip.train", description=__doc__)
    parser.add_argument("job", type=Path, help="the resolved job spec, usually RUN_DIR/job.json")
    args = parser.parse_args(argv)
    try:
        job = load_job(args.job)
    except SpecError as exc:
        print(f"fsdpclip.train: {args.job} is not a valid job spec:\n{exc}", file=sys.stderr)
        return 2
    env = init_distributed(job.launch.device, job.launch.collective_timeout_s, cpu_collectives=job.fsdp.cpu_offload)
    logging.basicConfig(level=logging.INFO if env.is_main else logging.WARNING,
                        format=f"[rank {env.rank}] %(levelname)s %(name)s: %(message)s")
    run_dir = run_dir_of(job)
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        trainer = Trainer(job, env, run_dir)
        trainer.fit()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
