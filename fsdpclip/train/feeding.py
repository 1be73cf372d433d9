"""The trainer's data hooks: the rank's batches from the registered data source, and the time a step waits
for them."""

from __future__ import annotations

import time
from collections import deque

import torch

from fsdpclip.node import local_ranks, usable_cores
from fsdpclip.spec.registry import DATA_SOURCES, RankData
from fsdpclip.train.metrics import Window


class DataFeed:
    """The part of `Trainer` that feeds it micro batches."""

    def _open_batches(self, model: torch.nn.Module, start: bool) -> None:
        """`batches` and `batch_iter` for `model` (`_batches`), the data workers started where `start` (a fresh
        run's fill their queues while the model is built; a resumed run's restart at its position)."""
        self.batches = self._batches(model)
        self.batch_iter = iter(self.batches)
        if start:
            self.batches.start()

    def _close_batches(self) -> None:
        """Stop the data workers, where the batches were opened."""
        if self.batches is not None:
            self.batch_iter.close()
            self.batches.close()

    def _batches(self, model: torch.nn.Module):
        """The rank's batches from the spec's data source (`spec.registry.DataSource`) for `model` (its shapes
        and preprocessing; the meta-device model will do); also sets `images` (what turns a micro batch's
        images into the model's input on the device, e.g. transform.TrainImages; None where they are that
        already) and `waiting_hints` (what would feed a step that waits for them)."""
        job, env = self.job, self.env
        self.data_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # see _next_batch
        rank = RankData(model, self.tokenizer, job.batch.per_gpu, env.rank, env.world_size, job.run.seed, env.device,
                        env.is_main)
        source = DATA_SOURCES[job.data.source]
        batches, self.images = source.batches(job.data, rank)
        self.waiting_hints = source.waiting_hints(job.data, env.world_size, local_ranks(), usable_cores())
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
