"""Training data: webdataset shards, and a synthetic source generated on the device.

Both are resumable streams of micro batches. The webdataset stream is deterministic for a
given (seed, epoch, rank, worker), so a position (samples emitted per worker, and which
worker comes next) is enough to continue exactly where a run stopped.
"""

from __future__ import annotations

import io
import logging
import random
import signal
from dataclasses import asdict, dataclass, field
from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import tar_file_expander, url_opener, group_by_keys

from fsdpclip.spec import WebDatasetSpec
from fsdpclip.urls import shard_urls

log = logging.getLogger("fsdpclip.data")


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave SIGTERM/SIGINT/SIGUSR1 to their rank: a scheduler that signals every
    process of a job (Slurm's job step, `kill -TERM -PGID`, Ctrl-C, torchrun passing a signal on to
    each rank's process group) must reach the rank's stop-and-checkpoint, not kill a worker under it.
    The rank stops its workers itself (closing the loader), or they exit with it (their watchdog)."""
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, signal.SIG_IGN)


# ------------------------------------------------------------------- webdataset
def shuffled(samples: Iterator, size: int, rng: random.Random) -> Iterator:
    """A shuffle buffer of `size` samples (0: pass through)."""
    if size <= 1:
        yield from samples
        return
    buffer = []
    for sample in samples:
        buffer.append(sample)
        if len(buffer) >= size:
            index = rng.randrange(len(buffer))
            buffer[index], buffer[-1] = buffer[-1], buffer[index]
            yield buffer.pop()
    rng.shuffle(buffer)
    yield from buffer


class ShardStream(IterableDataset):
    """Micro batches decoded from webdataset shards by one rank's DataLoader workers.

    Worker `w` plays the logical worker `(w + worker_offset) % workers` and skips the first
    `skip[logical]` samples it would emit; every batch reports its logical worker, how many
    samples that worker has emitted so far and how many broken samples it skipped.
    """

    def __init__(self, spec: WebDatasetSpec, preprocess: Callable, tokenize: Callable, batch_size: int,
                 rank: int, world_size: int, seed: int):
        self.spec, self.preprocess, self.tokenize = spec, preprocess, tokenize
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.urls = shard_urls(spec.urls)
        self.image_keys = [k.strip().lower() for k in spec.image_key.split(";")]
        self.epoch, self.worker_offset, self.skip = 0, 0, {}

    def _shards(self, logical: int, workers: int, rng: random.Random) -> Iterator[str]:
        if self.spec.resampled:
            while True:
                yield rng.choice(self.urls)
        order = list(self.urls)
        random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        yield from order[self.rank::self.world_size][logical::workers]

    def _decode(self, sample: dict, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Image and tokens of one sample; its random augmentation depends only on `seed`."""
        from PIL import Image

        key = next((k for k in self.image_keys if k in sample), None)
        if key is None or self.spec.text_key not in sample:
            raise ValueError(f"sample {sample.get('__key__')} lacks an image or a '{self.spec.text_key}' caption")
        image = Image.open(io.BytesIO(sample[key]))
        image.load()
        caption = sample[self.spec.text_key].decode("utf-8")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pixels = self.preprocess(image.convert("RGB"))
        return pixels, self.tokenize([caption])[0]

    def _collate(self, images: list) -> torch.Tensor:
        """One micro batch of decoded images."""
        return torch.stack(images)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        logical = (worker + self.worker_offset) % workers
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{logical}")
        broken = [0]

        def count_and_continue(exn: Exception) -> bool:
            broken[0] += 1
            log.warning("skipping a broken shard or sample: %s", exn)
            return True

        sources = ({"url": url} for url in self._shards(logical, workers, rng))
        files = tar_file_expander(url_opener(sources, handler=count_and_continue), handler=count_and_continue)
        samples = shuffled(group_by_keys(files, handler=count_and_continue), self.spec.shuffle_buffer, rng)
        skip, emitted = self.skip.get(logical, 0), 0
        images, texts = [], []
        for sample in samples:
            emitted += 1
            if emitted <= skip:
                continue
            try:
                image, text = self._decode(sample, hash((self.seed, self.epoch, self.rank, logical, emitted)))
            except Exception as exc:  # a broken sample must never stop the run
                count_and_continue(exc)
                continue
            images.append(image)
            texts.append(text)
            if len(images) == self.batch_size:
                yield {"images": self._collate(images), "texts": torch.stack(texts), "worker": logical,
                       "position": emitted, "broken": broken[0]}
                images, texts, broken[0] = [], [], 0


@dataclass
class StreamPosition:
    """Where one rank's webdataset stream stands: enough to continue it exactly."""

    epoch: int = 0
    emitted: dict[int, int] = field(default_factory=dict)  # logical worker -> samples emitted
    next_worker: int = 0
    broken: int = 0  # broken samples skipped so far, in total


class WebDatasetBatches:
    """An endless iterator of (images, texts) micro batches for one rank, epoch after epoch."""

    def __init__(self, stream: ShardStream, workers: int, pin_memory: bool):
        self.stream, self.workers, self.pin_memory = stream, workers, pin_memory
        self.position = StreamPosition()

    def state_dict(self) -> dict:
        return asdict(self.position)

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position (before the first batch is drawn)."""
        self.position = StreamPosition(**state)

    def __iter__(self):
        while True:
            self.stream.epoch = self.position.epoch
            self.stream.worker_offset = self.position.next_worker
            self.stream.skip = dict(self.position.emitted)
            loader = DataLoader(self.stream, batch_size=None, num_workers=self.workers, pin_memory=self.pin_memory,
                                prefetch_factor=4 if self.workers else None, worker_init_fn=ignore_stop_signals)
            produced, batches = False, iter(loader)
            try:
                for batch in batches:
                    produced = True
                    position = self.position
                    position.emitted[batch["worker"]] = batch["position"]
                    position.next_worker = (batch["worker"] + 1) % max(1, self.workers)
                    position.broken += batch["broken"]
                    yield batch["images"], batch["texts"]
            finally:  # also when the consumer closes this generator: the workers stop now, not at exit
                shutdown = getattr(batches, "_shutdown_workers", None)
                if shutdown is not None:
                    shutdown()
            if not produced and not self.position.emitted:
                raise RuntimeError(f"rank {self.stream.rank} got no complete batch from its shards in epoch "
                                   f"{self.position.epoch}: too few samples for batch {self.stream.batch_size}")
            self.position = StreamPosition(epoch=self.position.epoch + 1, broken=self.position.broken)


# -------------------------------------------------------------------- synthetic
class SyntheticBatches:
    """Random images and token ids made on the device: no decode, no host work (benchmarks).

    Batch `index` of rank `rank` depends only on (seed, index, rank), so any world size can
    rebuild another's global batch.
    """

    def __init__(self, image_shape: tuple[int, int, int], context: int, vocab: int, batch_size: int,
                 device: torch.device, seed: int, rank: int):
        self.image_shape, self.context, self.vocab = image_shape, context, vocab
        self.batch_size, self.device, self.seed, self.rank = batch_size, device, seed, rank
        self.index = 0

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]

    def batch(self, index: int, rank: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator(device=self.device)
        generator.manual_seed(hash((self.seed, index, self.rank if rank is None else rank)) & (2 ** 62 - 1))
        images = torch.randn(self.batch_size, *self.image_shape, generator=generator, device=self.device)
        texts = torch.randint(1, self.vocab, (self.batch_size, self.context), generator=generator, device=self.device)
        return images, texts

    def __iter__(self):
        while True:
            self.index += 1
            yield self.batch(self.index - 1)
