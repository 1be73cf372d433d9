"""The trainer's data hooks: the rank's batches from the registered data source, and the time a step waits
for them."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Iterator, Optional

import torch

from fsdpclip.node import local_ranks, usable_cores
from fsdpclip.data.source import DATA_SOURCES, RankData
from fsdpclip.train.metrics import Window
from fsdpclip.train.state import TrainerState


class DataFeed(TrainerState):
    """The part of `Trainer` that feeds it micro batches."""

    def _open_batches(self, model: torch.nn.Module, start: bool, data_ranks: Optional[int] = None) -> None:
        """`batches` and `batch_iter` for `model` (`_batches`), the data workers started where `start` (a fresh
        run's fill their queues while the model is built; a resumed run's restart at its position). With more
        `data_ranks` than ranks (a run resumed on fewer ranks, going on with the data of those that saved it),
        this rank reads the streams of `data_ranks ÷ world size` of them in turn (`HostedStreams`)."""
        world = self.env.world_size
        self.data_ranks = data_ranks or world
        hosted = self.data_ranks // world
        if hosted == 1:
            self.batches = self._batches(model, self.env.rank)
        else:
            streams = range(self.env.rank * hosted, (self.env.rank + 1) * hosted)
            self.batches = HostedStreams({s: self._batches(model, s) for s in streams},
                                         self.job.batch.grad_accum // hosted)
        self.batch_iter = iter(self.batches)
        if start:
            self.batches.start()

    def _close_batches(self) -> None:
        """Stop the data workers, where the batches were opened."""
        if self.batches is not None:
            self.batch_iter.close()
            self.batches.close()

    def _batches(self, model: torch.nn.Module, stream: int):
        """The batches of data rank `stream` from the spec's data source (`data.source.DataSource`) for `model`
        (its shapes and preprocessing; the meta-device model will do); also sets `images` (what turns a micro
        batch's images into the model's input on the device, e.g. transform.TrainImages; None where they are that
        already) and `waiting_hints` (what would feed a step that waits for them)."""
        job, env = self.job, self.env
        self.data_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # see _next_batch
        rank = RankData(model, self.tokenizer, job.batch.settled_per_gpu, stream, self.data_ranks, job.run.seed,
                        env.device, env.is_main, self.plan.data)
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

    def _judge_supply(self, window: Window) -> None:
        """Tell batches that adapt to it (`supply_waited`: the JPEG engines' share) how long the step waited for
        the window's micro batches."""
        judge = getattr(self.batches, "supply_waited", None)
        if judge is not None:
            judge(window.data_wait, time.perf_counter() - window.start, window.steps * self.job.batch.grad_accum)

    def _fetch(self) -> tuple[torch.Tensor, torch.Tensor]:
        images, texts = next(self.batch_iter)
        self.startup.mark("first_batch")
        if self.images is not None:
            images = self.images(images)
        return images, texts.to(self.env.device, non_blocking=True)


class HostedStreams:
    """The data streams of several data ranks, read by one rank: each step takes `per_stream` micro batches of
    each in turn, the order in which the ranks that saved them contributed to the global batch (a run resumed on
    fewer ranks than began it goes on with exactly their data). A data source's batches' protocol, over them."""

    def __init__(self, streams: dict[int, Any], per_stream: int):
        self.streams, self.per_stream = streams, per_stream

    def __iter__(self) -> Iterator:
        iterators = [iter(stream) for stream in self.streams.values()]
        try:
            while True:
                for iterator in iterators:
                    for _ in range(self.per_stream):
                        yield next(iterator)
        finally:  # the streams' workers stop with this generator
            for iterator in iterators:
                iterator.close()

    def start(self) -> None:
        for stream in self.streams.values():
            stream.start()

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()

    @property
    def broken(self) -> int:
        return sum(stream.broken for stream in self.streams.values())

    @property
    def source_samples(self) -> dict[str, int]:
        totals: Counter = Counter()
        for stream in self.streams.values():
            totals.update(getattr(stream, "source_samples", {}))
        return dict(totals)

    def state_dict(self) -> dict:
        return {"streams": {str(index): stream.state_dict() for index, stream in self.streams.items()}}

    def load_state_dict(self, state: dict) -> None:
        for index, stream in self.streams.items():
            stream.load_state_dict(state["streams"][str(index)])
