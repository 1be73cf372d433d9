"""What each data worker reads: one rank's webdataset shards as a deterministic stream of micro batches.

The stream is deterministic for a given (seed, epoch, rank, worker): every rank and logical worker draws a
fixed quota of micro batches per epoch (reading its shards again, in another order, when they run out), and
a position says where each worker's reading stands (its pass over its shards, the shard and the sample in
it, its shuffle buffer as (shard, sample) references, its RNG), so that a resumed run reads only the shards
it needs and continues exactly where a run stopped. A mixture (`data.sources`) is read as several such
readings, one per source, each sample's source drawn by the weights from the worker's mixing RNG, which
the position keeps too. The rank's side (the DataLoader over it, the position
a checkpoint keeps) is `fsdpclip.data.batches`.
"""

from __future__ import annotations

import bisect
import copy
import io
import itertools
import logging
import random
from dataclasses import dataclass, field
from typing import Callable, Generator, Iterator, Optional

import torch
from torch.utils.data import IterableDataset, get_worker_info

from fsdpclip.data.augment import random_resized_crop
from fsdpclip.data.engines import to_engines
from fsdpclip.data.jpeg import read_header, refuse_huge
from fsdpclip.data.tarshards import shard_samples
from fsdpclip.data.transform import CroppedBatch, CroppedImage, EncodedBatch, EncodedJpeg, collate, cropped, for_device
from fsdpclip.jobspec.urls import shard_urls
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.jobspec.job import batches_per_epoch

log = logging.getLogger("fsdpclip.data.stream")

Ref = tuple[int, int]  # a sample: (its shard's index in the URL list, its place among the shard's samples)
# A worker stops with an error after this many unusable samples in a row (plus 20 shuffle buffers): the
# data or its keys are wrong; a broken shard now and then is skipped.
UNUSABLE_IN_A_ROW = 10_000


@dataclass
class Reading:
    """Where one logical worker's reading of one source's shards stands."""

    passes: int = 0  # passes over its shards finished before the current one (each pass has its own order)
    cursor: int = 0  # shards of the current pass begun before the current one (resampled: shards drawn)
    offset: int = 0  # samples read from the current shard


@dataclass
class WorkerPosition:
    """Where one logical worker's stream of an epoch stands after its last batch."""

    batches: int = 0  # micro batches it yielded in this epoch
    readings: list[Reading] = field(default_factory=list)  # each source's reading (none yet: at their start)
    emitted: int = 0  # samples its shuffle gave out in this epoch (they seed the augmentations)
    buffer: list[Ref] = field(default_factory=list)  # the shuffle buffer's samples, in buffer order
    rng: Optional[tuple] = None  # the shuffle's random.Random state (None: not started)
    mixer: Optional[tuple] = None  # a mixture's random.Random state drawing each sample's source (None: not started)


class DataError(RuntimeError):
    """A data worker cannot go on (no shard, nothing readable, nothing usable): the rank stops with
    this message (a worker process hands it over in place of a batch, not as a traceback)."""


class _Broken:
    """The webdataset handler: counts broken shards and samples and carries on. Not counting while a
    resumed worker reads again what its position says was read (and counted) before."""

    def __init__(self):
        self.count, self.counting = 0, True

    def __call__(self, exn: Exception) -> bool:
        if self.counting:
            self.count += 1
            log.warning("skipping a broken shard or sample: %s", exn)
        return True

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


class _Reader:
    """One logical worker's samples of one source in an epoch, in stream order, as (ref, sample); the
    reading's pass, cursor and offset follow what was read."""

    def __init__(self, stream: "ShardStream", logical: int, workers: int, source: int, position: Reading,
                 broken: _Broken):
        self.stream, self.logical, self.workers, self.position, self.broken = stream, logical, workers, position, broken
        self.source, self.resampled = source, stream.spec.resampled
        self.shards = None if self.resampled else stream._pass_shards(logical, workers, position.passes, source)
        if self.shards == []:
            raise DataError(f"rank {stream.rank}'s data worker {logical} has no shard{stream.of_source(source)}: "
                            f"{len(stream.sources[source])} shards for {stream.world_size} ranks × {workers} "
                            f"workers (it needs ≥ {stream.world_size * workers}, or data.resampled)")
        self.current: Optional[tuple[int, Iterator[dict]]] = None  # the open shard: (index, its samples)
        self.pass_samples: Optional[int] = None  # samples read in this pass, if it began here
        self.empty_shards = 0  # shards in a row that gave no sample

    def _shard(self) -> int:
        """The current shard's index in the URL list (beginning the next pass after the last shard)."""
        position = self.position
        if self.resampled:
            return self.stream._drawn_shard(self.logical, position.cursor, self.source)
        assert self.shards is not None  # not resampled: this pass's shards
        if position.cursor >= len(self.shards):
            if self.pass_samples == 0:
                raise DataError(f"rank {self.stream.rank}'s data worker {self.logical}: its {len(self.shards)} "
                                f"shard(s){self.stream.of_source(self.source)} hold no readable sample")
            position.passes, position.cursor = position.passes + 1, 0
            self.shards = self.stream._pass_shards(self.logical, self.workers, position.passes, self.source)
        if position.cursor == 0 and position.offset == 0:
            self.pass_samples = 0
        return self.shards[position.cursor]

    def __next__(self) -> tuple[Ref, dict]:
        position = self.position
        while True:
            if self.current is None:
                index = self._shard()
                self.current = (index, iter(self.stream._shard_samples(index, self.broken)))
            index, samples = self.current
            sample = next(samples, None)
            if sample is not None:
                position.offset += 1
                self.empty_shards = 0
                if self.pass_samples is not None:
                    self.pass_samples += 1
                return (index, position.offset - 1), sample
            if position.offset == 0:
                self.empty_shards += 1
                if self.resampled and self.empty_shards >= max(100, 2 * len(self.stream.sources[self.source])):
                    raise DataError(f"rank {self.stream.rank}'s data worker {self.logical}: {self.empty_shards} "
                                    f"shards drawn in a row{self.stream.of_source(self.source)} hold no readable "
                                    f"sample")
            self.current = None
            position.cursor, position.offset = position.cursor + 1, 0

    def restore(self, refs: list[Ref]) -> dict[Ref, dict]:
        """Read again what a saved position needs of this source, and nothing more: the current shard up
        to its offset (left open to go on from there) and each buffered sample's shard (`refs`, of this
        source's shards) up to the deepest one buffered, the bytes of the buffered samples only (the
        others' are skipped: tar headers alone). What is read again is not counted as broken again.
        Returns the buffered samples found, by ref."""
        position = self.position
        needed: dict[int, set[int]] = {}
        for index, offset in refs:
            needed.setdefault(index, set()).add(offset)
        found: dict[Ref, dict] = {}
        self.broken.counting = False
        try:
            if position.offset:  # the current shard: read up to where it stands, keep it open
                index = self._shard()
                here = needed.get(index, set())
                start = position.offset  # the samples before it: keys only, but for the buffered ones
                samples = iter(self.stream._shard_samples(index, self.broken,
                                                          lambda offset: offset in here or offset >= start))
                for offset in range(position.offset):
                    sample = next(samples, None)
                    if sample is None:
                        log.warning("shard %s now holds %d samples, fewer than the %d the saved position read: "
                                    "it changed since", self.stream.urls[index], offset, position.offset)
                        position.offset = offset
                        break
                    if offset in here:
                        found[(index, offset)] = sample
                        here.discard(offset)
                self.current = (index, samples)
            for index, offsets in needed.items():  # the buffer's other shards (and this one, seen before)
                offsets = offsets - {offset for i, offset in found if i == index}
                if not offsets:
                    continue
                samples = self.stream._shard_samples(index, self.broken, offsets.__contains__)
                for offset, sample in enumerate(samples):
                    if offset in offsets:
                        found[(index, offset)] = sample
                    if offset >= max(offsets):
                        break
                samples.close()
        finally:
            self.broken.counting = True
        return found


class ShardStream(IterableDataset):
    """Micro batches decoded from webdataset shards by one rank's DataLoader workers.

    Each logical worker reads its own shards of the epoch (`order[rank::world][logical::workers]`; drawn
    with replacement when resampled) through a shuffle buffer and yields exactly its quota of the
    rank's `batches_per_epoch` micro batches, reading its shards again (in another order each pass)
    when they run out. With several sources it does so for each source's shards, and draws the source
    of each sample it reads by the sources' weights. Worker `w` plays the logical worker
    `(w + worker_offset) % workers` and goes on from `resume[logical]` (a WorkerPosition) if given;
    every batch reports its logical worker, the worker's position after it, its samples from each
    source and how many broken samples were skipped since its last batch.
    """

    def __init__(self, spec: WebDatasetSpec, preprocess: Callable, tokenize: Callable, batch_size: int,
                 rank: int, world_size: int, seed: int):
        self.spec, self.preprocess, self.tokenize = spec, preprocess, tokenize
        self.crop = random_resized_crop(preprocess.transforms) if spec.decode in ("gpu", "mixed") else None
        self.engine_share: Optional[torch.Tensor] = None  # "mixed": the share of JPEGs left to the engines (shared)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        mixture = spec.mixture()
        self.urls: list[str] = []
        self.sources: list[range] = []  # each source's shards: indices into `urls`
        for source in mixture:
            start = len(self.urls)
            self.urls += shard_urls(source.urls)
            self.sources.append(range(start, len(self.urls)))
        self.starts = [shards.start for shards in self.sources]
        self.names = [source.name or str(i) for i, source in enumerate(mixture)]  # mixture() names each
        self.cumulative_weights = list(itertools.accumulate(source.weight for source in mixture))
        self.image_keys = [k.strip().lower() for k in spec.image_key.split(";")]
        self.epoch, self.worker_offset = 0, 0
        self.resume: dict[int, WorkerPosition] = {}
        assert spec.samples is not None  # given, or the sources' sum (validated)
        self.batches_per_epoch = batches_per_epoch(spec.samples, world_size, batch_size)
        if self.batches_per_epoch == 0:
            raise ValueError(f"data.samples {spec.samples} holds no micro batch of {batch_size} for each of "
                             f"{world_size} ranks")

    def quota(self, logical: int, workers: int) -> int:
        """Micro batches logical worker `logical` of `workers` yields per epoch: the rank's, split as
        evenly as possible (the first workers one more)."""
        return self.batches_per_epoch // workers + (logical < self.batches_per_epoch % workers)

    def source_of(self, index: int) -> int:
        """The source of the shard at `index` in the URL list."""
        return bisect.bisect_right(self.starts, index) - 1

    def of_source(self, source: int) -> str:
        """' of source NAME' in a mixture's messages, '' for one source."""
        return f" of source '{self.names[source]}'" if len(self.sources) > 1 else ""

    def _seed(self, source: int) -> str:
        """The seed of a source's shard order in this epoch (the first source's: a single source's)."""
        return f"{self.seed}/{self.epoch}" + (f"/source/{source}" if source else "")

    def _pass_shards(self, logical: int, workers: int, passes: int, source: int = 0) -> list[int]:
        """The shards of `source` (indices into the URL list) a logical worker reads in pass `passes` of the epoch."""
        order = list(self.sources[source])
        random.Random(self._seed(source)).shuffle(order)
        mine = order[self.rank::self.world_size][logical::workers]
        if passes:
            random.Random(f"{self._seed(source)}/{self.rank}/{logical}/pass/{passes}").shuffle(mine)
        return mine

    def _drawn_shard(self, logical: int, cursor: int, source: int = 0) -> int:
        """Resampled: the shard of `source` a logical worker draws as its `cursor`-th of the epoch."""
        shards = self.sources[source]
        return shards[random.Random(f"{self._seed(source)}/{self.rank}/{logical}/draw/{cursor}").randrange(len(shards))]

    def _restore(self, readers: list[_Reader], refs: list[Ref]) -> list[tuple[Ref, dict]]:
        """A saved shuffle buffer read again (each source's samples by its reader: _Reader.restore), in its order."""
        wanted: list[Ref] = [(ref[0], ref[1]) for ref in refs]  # (lists, read back from JSON)
        found: dict[Ref, dict] = {}
        for reader in readers:
            found.update(reader.restore([ref for ref in wanted if self.source_of(ref[0]) == reader.source]))
        lost = [ref for ref in wanted if ref not in found]
        if lost:
            log.warning("%d buffered samples are no longer in their shards (%s, ...): the data changed since the "
                        "checkpoint", len(lost), self.urls[lost[0][0]])
        return [(ref, dict(found[ref])) for ref in wanted if ref in found]

    def _shard_samples(self, index: int, handler: Callable[[Exception], bool],
                       wanted: Optional[Callable[[int], bool]] = None) -> Generator[dict, None, None]:
        """The samples of one shard, in order (broken members and shards go to `handler`; those not
        `wanted` with their keys only: tarshards.shard_samples)."""
        return shard_samples(self.urls[index], handler, wanted)

    def _decode(self, sample: dict, seed: int) -> tuple[torch.Tensor | EncodedJpeg | CroppedImage, str]:
        """Image and caption of one sample; the image's random augmentation is what `preprocess` draws with
        torch's generator seeded with `seed`. With `spec.decode` "gpu" (settled by the trainer:
        transform.decode_mode) a JPEG the device decodes stays encoded, with the crop box `preprocess` would
        draw for it; with "mixed" every image is decoded and cut to that box, but the JPEGs the engines' share
        draws (`engines.to_engines`), which stay encoded as for "gpu"."""
        key = next((k for k in self.image_keys if k in sample), None)
        if key is None or self.spec.text_key not in sample:
            raise ValueError(f"sample {sample.get('__key__')} lacks an image or a '{self.spec.text_key}' caption")
        data, caption = sample[key], sample[self.spec.text_key].decode("utf-8")
        if self.crop is None:  # "cpu": PIL reads the header as it opens the image
            from PIL import Image

            image = Image.open(io.BytesIO(data))
            refuse_huge(image.height, image.width)
            return self._preprocessed(image, seed), caption
        header = read_header(data)
        if self.spec.decode == "mixed":
            if self.engine_share is not None and to_engines(seed, float(self.engine_share[0])):
                jpeg = for_device(data, header, self.crop, seed)
                if jpeg is not None:
                    jpeg.engines = True
                    return jpeg, caption
            return cropped(data, header, self.crop, seed), caption
        pixels = for_device(data, header, self.crop, seed)
        return (pixels if pixels is not None else self._preprocessed(header.image(data), seed)), caption

    def _preprocessed(self, image, seed: int) -> torch.Tensor:
        """`image` (opened by PIL) through the worker transform, its random draws from torch's generator seeded
        with `seed`."""
        image.load()
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # torch.manual_seed also queues device seeding: 0.2 ms
            return self.preprocess(image.convert("RGB"))

    def _tokens(self, captions: list[str], broken: _Broken) -> tuple[Optional[torch.Tensor], dict[int, Exception]]:
        """A batch's captions tokenised in one call. Where that raises, each caption alone: those that raise
        are broken samples, returned by index with what they raised (and no tokens)."""
        try:
            return self.tokenize(captions), {}
        except Exception as batch_error:
            rows, refused = [], {}
            for index, caption in enumerate(captions):
                try:
                    rows.append(self.tokenize([caption]))
                except Exception as exc:
                    broken(exc)
                    refused[index] = exc
            if refused:
                return None, refused
            log.warning("tokenising a batch's captions raised (%s), each caption alone did not", batch_error)
            return torch.cat(rows), {}

    def _collate(self, images: list) -> torch.Tensor | EncodedBatch | CroppedBatch:
        """One micro batch of images (transform.collate)."""
        return collate(images)

    def __iter__(self):
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        try:
            yield from self.worker_batches((worker + self.worker_offset) % workers, workers)
        except DataError as exc:
            yield {"error": str(exc)}

    def worker_batches(self, logical: int, workers: int) -> Iterator[dict]:
        """The rest of logical worker `logical`'s batches of this epoch (from `resume[logical]`, if given)."""
        quota = self.quota(logical, workers)
        position = copy.deepcopy(self.resume.get(logical)) or WorkerPosition()
        if position.batches >= quota:
            return
        rng = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{logical}")
        if position.rng is not None:
            rng.setstate(position.rng)
        broken = _Broken()
        position.readings = position.readings or [Reading() for _ in self.sources]
        readers = [_Reader(self, logical, workers, source, reading, broken)
                   for source, reading in enumerate(position.readings)]
        buffer = self._restore(readers, position.buffer)
        mixer = random.Random(f"{self.seed}/{self.epoch}/{self.rank}/{logical}/mix") if len(readers) > 1 else None
        if mixer is not None and position.mixer is not None:
            mixer.setstate(position.mixer)
        size = self.spec.shuffle_buffer
        images, texts, origins, failed, refused_in_a_row = [], [], [], 0, 0

        def read() -> tuple[Ref, dict]:  # the next sample of the source the weights draw
            reader = readers[0] if mixer is None else mixer.choices(readers, cum_weights=self.cumulative_weights)[0]
            return next(reader)

        while position.batches < quota:
            if size <= 1:
                ref, sample = read()
            else:  # the shuffle: its choices depend only on the RNG and the buffer's length
                while len(buffer) < size:
                    buffer.append(read())
                index = rng.randrange(len(buffer))
                buffer[index], buffer[-1] = buffer[-1], buffer[index]
                ref, sample = buffer.pop()
            position.emitted += 1
            try:
                image, text = self._decode(sample, hash((self.seed, self.epoch, self.rank, logical, position.emitted)))
            except Exception as exc:  # a broken sample must never stop the run
                broken(exc)
                failed += 1
                if failed >= UNUSABLE_IN_A_ROW + 20 * size:  # but nothing usable at all must
                    raise DataError(f"rank {self.rank}'s data worker {logical}: {failed} samples in a row "
                                    f"could not be used (the last: {exc}); check data.image_key and "
                                    f"data.text_key") from exc
                continue
            failed = 0
            images.append(image)
            texts.append(text)
            origins.append(self.source_of(ref[0]))
            if len(images) == self.batch_size:
                tokens, refused = self._tokens(texts, broken)
                if refused:  # broken samples: the batch fills up again
                    refused_in_a_row += len(refused)
                    if refused_in_a_row >= UNUSABLE_IN_A_ROW + 20 * size:
                        raise DataError(f"rank {self.rank}'s data worker {logical}: {refused_in_a_row} captions in a "
                                        f"row could not be tokenised (the last: {list(refused.values())[-1]})")
                    images = [image for index, image in enumerate(images) if index not in refused]
                    texts = [text for index, text in enumerate(texts) if index not in refused]
                    origins = [origin for index, origin in enumerate(origins) if index not in refused]
                    continue
                refused_in_a_row = 0
                position.batches += 1
                state = WorkerPosition(position.batches, copy.deepcopy(position.readings), position.emitted,
                                       [ref for ref, _ in buffer], rng.getstate(),
                                       mixer.getstate() if mixer is not None else None)
                yield {"images": self._collate(images), "texts": tokens, "worker": logical, "position": state,
                       "sources": [origins.count(source) for source in range(len(self.sources))],
                       "broken": broken.take()}
                images, texts, origins = [], [], []
