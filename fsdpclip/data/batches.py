"""One rank's webdataset micro batches: the DataLoader over its workers' streams (`fsdpclip.data.stream`),
epoch after epoch, and the position a checkpoint keeps to continue it exactly.
"""

from __future__ import annotations

import itertools
import logging
import signal
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader

from fsdpclip.data.engines import INSTALL, EngineShare, missing, worker_context
from fsdpclip.data.stream import Reading, ShardStream, WorkerPosition
from fsdpclip.jobspec.problems import Problem, SpecError
from fsdpclip.data.transform import TrainImages
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec

log = logging.getLogger("fsdpclip.data.batches")


class WorkerStart:
    """What each DataLoader worker does first: `ignore_stop_signals`, and log as the rank logs (its level and
    format, which a worker started from a fork server does not inherit)."""

    def __init__(self):
        root = logging.getLogger()
        formatter = root.handlers[0].formatter if root.handlers else None
        self.level = root.level
        self.formatter = formatter if type(formatter) is logging.Formatter else None  # the rank's, as configured

    def __call__(self, worker_id: int) -> None:
        ignore_stop_signals(worker_id)
        root = logging.getLogger()
        if self.formatter is not None and not root.handlers:
            handler = logging.StreamHandler()
            handler.setFormatter(self.formatter)
            root.addHandler(handler)
            root.setLevel(self.level)


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT/SIGUSR1 to their rank: a scheduler that signals every
    process of a job (Slurm's job step, `kill -TERM -PGID`, Ctrl-C, torchrun passing a signal on to
    each rank's process group) must reach the rank's stop-and-checkpoint, not kill a worker under it.
    The rank stops its workers itself (closing the loader), or they exit with it (their watchdog)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


# ------------------------------------------------------------------- webdataset
@dataclass
class StreamPosition:
    """Where one rank's webdataset stream stands: enough to continue it exactly."""

    epoch: int = 0
    batches: int = 0  # micro batches yielded in this epoch (the next comes from logical worker batches % workers)
    workers: dict[int, WorkerPosition] = field(default_factory=dict)  # logical worker -> where it stands
    broken: int = 0  # broken samples skipped so far, in total
    sources: list[int] = field(default_factory=list)  # samples given out from each source so far, in total


PREFETCH = 4  # micro batches each data worker makes ahead of the step


class WebDatasetBatches:
    """An endless iterator of (images, texts) micro batches for one rank, epoch after epoch, each epoch
    exactly `stream.batches_per_epoch` of them, taken from the logical workers in turn."""

    def __init__(self, stream: ShardStream, workers: int, pin_memory: bool, settled: bool = False,
                 engines: bool = False):
        self.stream, self.workers, self.pin_memory = stream, workers, pin_memory
        self.settled = settled  # `workers` settled from 'auto': a resumed stream keeps its saved count
        self.position = StreamPosition()
        self.started: Optional[Iterator] = None  # a loader set going ahead (`start`, the next epoch's), not iterated
        # data.jpeg_engines: the share of JPEGs the workers leave to the hardware JPEG engines, judged over windows
        # longer than the batches the workers hold ahead
        self.engines = EngineShare(window=2 * max(1, workers) * PREFETCH) if engines else None
        stream.engine_share = None if self.engines is None else self.engines.value

    def start(self) -> None:
        """Set the data workers going now: they fill their prefetch queues while the rest of the run
        is set up (the model built and sharded), and the first step finds its batch waiting. The
        position is fixed from here on (a resumed run loads it first). Iterating takes this loader
        over; `close` stops it if nothing does."""
        if self.started is None and self.position.batches < self.stream.batches_per_epoch:
            self.started = self._loader(self.position)

    def close(self) -> None:
        """Stop the workers set going ahead (by `start`, or the next epoch's), if no iteration took them over."""
        started, self.started = self.started, None
        if started is not None:
            shutdown_workers(started)

    @property
    def broken(self) -> int:
        """Broken samples skipped so far."""
        return self.position.broken

    def supply_waited(self, waited: float, elapsed: float, batches: int) -> None:
        """The step waited `waited` of `elapsed` seconds for its last `batches` micro batches (the trainer's
        measure): the JPEG engines' share follows it."""
        if self.engines is not None:
            self.engines.observe(waited, elapsed, batches)

    @property
    def jpeg_engine_share(self) -> Optional[float]:
        """The share of JPEGs the workers now leave to the hardware JPEG engines (None: they take none here)."""
        return None if self.engines is None else self.engines.share

    @property
    def source_samples(self) -> dict[str, int]:
        """A mixture's samples given out from each source so far, by name (empty for one source)."""
        names = self.stream.names
        return dict(zip(names, self.position.sources or [0] * len(names))) if len(names) > 1 else {}

    def restart(self, micro_batches: int, epoch: int) -> None:
        """Start at the beginning of `epoch` (where a run resumed without a usable saved position goes on)."""
        self.position = StreamPosition(epoch=epoch)

    def state_dict(self) -> dict:
        return {**asdict(self.position), "worker_count": self.workers}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (before the first batch is drawn)."""
        from fsdpclip.checkpoint.layout import CheckpointError

        if self.started is not None:
            raise RuntimeError("internal: the data position is loaded after the data workers were started")
        state = dict(state)
        saved_workers = state.pop("worker_count", None)
        if self.settled and saved_workers and saved_workers != self.workers:
            log.info("data.workers 'auto': %d workers, as the checkpoint's stream had (%d here), so that its data "
                     "position carries on exactly", saved_workers, self.workers)
            self.workers = saved_workers
        try:
            self.position = StreamPosition(**{**state, "workers": {
                int(w): _worker_position(s) for w, s in state["workers"].items()}})
        except (TypeError, KeyError, AttributeError, ValueError):
            keys = ", ".join(sorted(state)) if isinstance(state, dict) else type(state).__name__
            raise CheckpointError(f"the checkpoint's data position ({keys}) is not one this fsdpclip reads (it "
                                  "was saved by an older version, which replayed the stream): resume it with that "
                                  "version, or start a new run (another run.name, or checkpoint.resume null)") from None

    def __iter__(self):
        """The batches, epoch after epoch. The next epoch's workers start while this epoch's last
        `workers × PREFETCH` batches are taken (all of them already asked of this epoch's workers), so
        that the next epoch's first batches are ready when it begins."""
        workers, per_epoch = max(1, self.workers), self.stream.batches_per_epoch
        while True:
            position = self.position
            if position.batches < per_epoch:
                batches = self.started if self.started is not None else self._loader(position)
                self.started = None
                try:
                    for batch in batches:
                        if "error" in batch:
                            raise RuntimeError(batch["error"])
                        if batch["worker"] != position.batches % workers:
                            raise RuntimeError(f"internal: batch {position.batches} of epoch {position.epoch} came "
                                               f"from data worker {batch['worker']}, not {position.batches % workers}")
                        position.batches += 1
                        position.workers[batch["worker"]] = batch["position"]
                        position.broken += batch["broken"]
                        position.sources = [held + drawn for held, drawn in
                                            itertools.zip_longest(position.sources, batch["sources"], fillvalue=0)]
                        if self.workers and self.started is None and \
                                per_epoch - position.batches <= self.workers * PREFETCH:
                            self.started = self._loader(StreamPosition(epoch=position.epoch + 1))
                        yield batch["images"], batch["texts"]
                    if position.batches != per_epoch:
                        raise RuntimeError(f"internal: rank {self.stream.rank} got {position.batches} batches in "
                                           f"epoch {position.epoch}, not {per_epoch}")
                except BaseException:  # the consumer closed this generator, or the data failed
                    self.close()  # the next epoch's workers, if started
                    raise
                finally:  # also when the consumer closes this generator: the workers stop now, not at exit
                    shutdown_workers(batches)
            self.position = StreamPosition(epoch=position.epoch + 1, broken=position.broken, sources=position.sources)

    def _loader(self, position: StreamPosition) -> Iterator:
        """A DataLoader's iterator over the stream from `position` (its workers start at once)."""
        self.stream.epoch = position.epoch
        self.stream.worker_offset = position.batches % max(1, self.workers)
        self.stream.resume = dict(position.workers)
        context = worker_context(self.engines is not None) if self.workers else None
        loader = DataLoader(self.stream, batch_size=None, num_workers=self.workers, pin_memory=self.pin_memory,
                            prefetch_factor=PREFETCH if self.workers else None, worker_init_fn=WorkerStart(),
                            multiprocessing_context=context)
        return iter(loader)


def with_worker_count(position: dict, saved_job: dict) -> dict:
    """A saved webdataset position (or a rank's several: {"streams": ...}) with the data workers that made it:
    its own count, else (saved before 'auto') the count its spec wrote."""
    if "streams" in position:
        return {"streams": {key: with_worker_count(part, saved_job) for key, part in position["streams"].items()}}
    written = saved_job.get("data", {}).get("workers")
    if "workers" in position and "worker_count" not in position and isinstance(written, int):
        return {**position, "worker_count": written}
    return position


def _worker_position(saved: dict) -> WorkerPosition:
    """A worker's saved position (one saved before mixtures holds its one reading in its own fields)."""
    saved = dict(saved)
    if "passes" in saved:
        saved["readings"] = [{key: saved.pop(key) for key in ("passes", "cursor", "offset")}]
    return WorkerPosition(**{**saved, "readings": [Reading(**reading) for reading in saved.get("readings", [])]})


def webdataset_batches(spec: WebDatasetSpec, settled: dict, transform: Callable, tokenizer: Callable,
                       batch_size: int, rank: int, world_size: int, seed: int, device: torch.device,
                       pin_memory: Optional[bool] = None) -> tuple[WebDatasetBatches, TrainImages]:
    """One rank's webdataset micro batches for a model's train `transform`, and what turns each into the
    model's input on `device`, with the block's 'auto' as the run plan `settled` them (`decode`, `jpeg_engines`,
    `workers`: `WebDatasetSource.plan`). The batches go through the pinning thread (which decodes 'gpu' batches)
    on CUDA unless `pin_memory` says otherwise."""
    decode, engines = settled["decode"], settled["jpeg_engines"]
    failed = engines and missing()  # installed, yet its import failed (a library it loads is missing)
    if failed:
        if spec.jpeg_engines is True:
            raise SpecError([Problem("data.jpeg_engines", failed, True, hint="data.jpeg_engines 'auto'")])
        if rank == 0:
            log.warning("data: the data workers decode every JPEG: %s", failed)
        engines = False
    images = TrainImages(transform, decode, device)
    stream = ShardStream(spec.model_copy(update={"decode": decode}), images.worker_transform, tokenizer, batch_size,
                         rank, world_size, seed)
    pin = device.type == "cuda" if pin_memory is None else pin_memory
    if rank == 0 and decode == "mixed" and device.type == "cuda" and not engines and spec.jpeg_engines == "auto" \
            and not failed:
        log.info("data: the data workers decode every JPEG: %s lets the GPU's hardware JPEG engines take a share",
                 INSTALL)
    return WebDatasetBatches(stream, settled["workers"], pin_memory=pin, settled=spec.workers == "auto",
                             engines=engines), images


def shutdown_workers(batches: Iterator) -> None:
    """Stop a DataLoader iterator's workers now rather than when it is collected (they ignore the
    stop signals, so a rank that fails while holding one must stop them itself)."""
    shutdown = getattr(batches, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
