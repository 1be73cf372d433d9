"""The trainer's data (`DataFeed`): the rank's batches from the registered data source, the time a step waits
for them, and their position and counts for checkpoints."""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any, Callable, Iterator, Optional

import torch

from fsdpclip.run.node import local_ranks, usable_cores
from fsdpclip.jobspec.source import DATA_SOURCES, RankData
from fsdpclip.parallel.distributed import Dist, all_sum
from fsdpclip.run.lock import StartupClock
from fsdpclip.jobspec.job import Job
from fsdpclip.train.metrics import Window


class DataFeed:
    """This rank's micro batches for `model` (its shapes and preprocessing; the meta-device model will do) from the
    spec's data source (`jobspec.source.DataSource`, with the block's `settled` 'auto' of the run plan), their
    workers started where `start` (a fresh run's fill their queues while the model is built; a resumed run's
    restart at its position). `next_batch` puts one on the device and counts the step's wait for it; `close`
    stops the workers. `data_ranks`: how many data ranks' streams the run reads (the world size, or that of the
    ranks whose data a resumed run goes on with); `waiting_hints`: what would feed a step that waits for them."""

    def __init__(self, job: Job, env: Dist, model: torch.nn.Module, tokenizer: Callable, settled: dict,
                 startup: StartupClock, start: bool):
        self.job, self.env, self.model, self.tokenizer, self.settled = job, env, model, tokenizer, settled
        self.startup = startup
        source = DATA_SOURCES[job.data.source]
        self.waiting_hints = source.waiting_hints(job.data, env.world_size, local_ranks(), usable_cores())
        self.counted: tuple[int, dict[str, int]] = (0, {})  # samples counted before a resume that restarted it
        self._open(env.world_size)
        if start:
            self.batches.start()

    def _open(self, data_ranks: int) -> None:
        """`batches` and `batch_iter` for the model (`_batches`). With more `data_ranks` than ranks (a run resumed
        on fewer ranks, going on with the data of those that saved it), this rank reads the streams of
        `data_ranks ÷ world size` of them in turn (`HostedStreams`)."""
        world = self.env.world_size
        self.data_ranks = data_ranks
        hosted = data_ranks // world
        self.data_spans: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()  # see next_batch
        self.batches: Any  # the data source's batches, or HostedStreams over several
        if hosted == 1:
            self.batches = self._batches(self.env.rank)
        else:
            streams = range(self.env.rank * hosted, (self.env.rank + 1) * hosted)
            self.batches = HostedStreams({s: self._batches(s) for s in streams}, self.job.batch.grad_accum // hosted)
        self.batch_iter: Any = iter(self.batches)  # a generator: closed with the batches

    def _batches(self, stream: int):
        """The batches of data rank `stream`; also sets `images`: what turns a micro batch's images into the
        model's input on the device (e.g. transform.TrainImages; None where they are that already)."""
        job, env = self.job, self.env
        rank = RankData(self.model, self.tokenizer, job.batch.settled_per_gpu, stream, self.data_ranks, job.run.seed,
                        env.device, env.is_main, self.settled)
        batches, self.images = DATA_SOURCES[job.data.source].batches(job.data, rank)
        return batches

    def reopen(self, data_ranks: int) -> None:
        """The streams of `data_ranks` data ranks instead (a resume that goes on with theirs), not started."""
        self.close()
        self._open(data_ranks)

    def close(self) -> None:
        """Stop the data workers."""
        self.batch_iter.close()
        self.batches.close()

    def next_batch(self, window: Window) -> tuple[torch.Tensor, torch.Tensor]:
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

    def judge_supply(self, window: Window) -> None:
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

    @property
    def jpeg_engine_share(self) -> Optional[float]:
        """This rank's share of the decoding on the GPU's JPEG engines, where the batches have them."""
        return getattr(self.batches, "jpeg_engine_share", None)

    def sample_counts(self) -> tuple[int, dict[str, int]]:
        """Broken samples skipped and a mixture's samples by source so far, over all ranks (collectives: every rank
        calls it), with those counted before a resume whose data started again (`restart`)."""
        by_source = getattr(self.batches, "source_samples", {})
        broken, *totals = all_sum([self.batches.broken, *by_source.values()], self.env.device)
        broken_before, sources_before = self.counted
        return int(broken) + broken_before, {name: int(total) + sources_before.get(name, 0)
                                             for name, total in zip(by_source, totals)}

    def state_dict(self) -> dict:
        """The position of this rank's streams (a checkpoint's rank state)."""
        return self.batches.state_dict()

    def load_state_dict(self, position: dict) -> None:
        """Go on from a saved position (`state_dict`'s)."""
        self.batches.load_state_dict(position)

    def restart(self, micro_batches: int, epoch: int, counted: tuple[int, dict[str, int]]) -> None:
        """Start the streams again at `epoch`, `micro_batches` into the run (a saved position that no longer
        holds); the sample counts go on from `counted` (broken samples, samples by source)."""
        self.batches.restart(micro_batches, epoch)
        self.counted = counted


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
