"""What the eval tasks read their sets with: data loaders whose workers stop with them, CLIP_benchmark's
webdataset shards and held-out image-text shards (a rank's share, split over its data workers), image files
with their captions, the text files of a set, and the rounds in which every rank takes part (`in_rounds`,
`gather_rows`).

Every rank takes part: each embeds its share of the images, and a rank whose share is exhausted keeps
running (padding) forwards until all are done, so no rank ever skips a forward of the sharded model.
"""

from __future__ import annotations

import io
import itertools
from pathlib import Path
from typing import Callable, ClassVar, Generator, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

from fsdpclip.data.batches import WorkerStart, shutdown_workers
from fsdpclip.data.engines import worker_context
from fsdpclip.jobspec.task import DatasetError
from fsdpclip.run.files import read_text_file

WDS_IMAGE_KEYS = ("webp", "png", "jpg", "jpeg")


def loader(data: Dataset, batch_size: Optional[int], workers: int, collate: Optional[Callable] = None) -> Iterator:
    """Batches of a map-style dataset, or of a `Shards` stream (`batch_size` None: it batches itself).
    Closing it stops its data workers at once (they ignore the stop signals, so none may outlive it). Its workers
    start from a fork server where this process holds the JPEG engines' decoder (during training)."""
    if isinstance(data, Shards):
        workers = min(workers, len(data.shards))
    batches = iter(DataLoader(data, batch_size=batch_size, num_workers=workers, collate_fn=collate,
                              worker_init_fn=WorkerStart(),
                              multiprocessing_context=worker_context() if workers else None))
    try:
        for batch in batches:
            if isinstance(batch, DatasetError):  # passed on by a data worker (see Shards)
                raise batch
            yield batch
    finally:
        shutdown_workers(batches)


class Shards(IterableDataset):
    """Batches from this rank's share of webdataset shards (every world_size-th), split over the data
    workers; at most `limit` images per worker (no worker needs more; `in_rounds` makes the total exact).
    `per_shard`: a batch ends with its shard (the last one of each shard may be short), so that the batches are the
    same however the shards are shared; otherwise it runs on into the worker's next shard."""

    per_shard: ClassVar[bool] = False
    image_keys: ClassVar[tuple[str, ...]] = WDS_IMAGE_KEYS  # a sample's image: the first of these it has

    def __init__(self, shards: list[str], rank: int, world_size: int, transform: Callable, batch_size: int,
                 limit: Optional[int]):
        self.shards = list(enumerate(shards))[rank::world_size]
        self.transform, self.batch_size, self.limit = transform, batch_size, limit

    def __iter__(self):
        batch, shard = [], None
        try:
            for sample_id, sample, where in itertools.islice(self._samples(), self.limit):
                if batch and self.per_shard and sample_id >> 32 != shard:
                    yield self.collate(batch)
                    batch = []
                shard = sample_id >> 32
                batch.append(self.read(sample_id, sample, where))
                if len(batch) == self.batch_size:
                    yield self.collate(batch)
                    batch = []
        except DatasetError as exc:  # to the main process as it is (a worker's exception comes wrapped in text)
            yield exc
            return
        if batch:
            yield self.collate(batch)

    def _samples(self) -> Iterator[tuple[int, dict, str]]:
        """(id, sample, where) of this worker's shards: id = the shard's index << 32 | the sample's position."""
        from fsdpclip.data.tarshards import shard_samples

        info = get_worker_info()
        for index, url in self.shards[info.id::info.num_workers] if info else self.shards:
            for position, sample in enumerate(shard_samples(url, handler=lambda exc: False)):  # errors raise
                yield index << 32 | position, sample, f"{url}: sample {sample['__key__']}"

    def image(self, sample: dict, where: str) -> torch.Tensor:
        from PIL import Image

        key = next((k for k in self.image_keys if k in sample), None)
        if key is None:
            raise DatasetError(f"{where} has no image ({', '.join('.' + k for k in self.image_keys)})")
        return self.transform(Image.open(io.BytesIO(sample[key])).convert("RGB"))

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        raise NotImplementedError

    def collate(self, batch: list[tuple]) -> tuple:
        raise NotImplementedError


class ClassShards(Shards):
    """(images, labels) from classification shards (an image and a .cls label)."""

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        return self.image(sample, where), int(sample["cls"])

    def collate(self, batch: list[tuple]) -> tuple:
        images, labels = zip(*batch)
        return torch.stack(images), torch.tensor(labels)


class CaptionShards(Shards):
    """(images, ids, captions) from retrieval shards (an image and a .txt of captions, one per line)."""

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        captions = caption_lines(sample["txt"].decode("utf-8")) if "txt" in sample else []
        if not captions:
            raise DatasetError(f"{where} has no captions (.txt, one per line)")
        return self.image(sample, where), sample_id, captions

    def collate(self, batch: list[tuple]) -> tuple:
        return collate_captioned(batch)


class PairShards(Shards):
    """(images, captions) from image-text shards (an image and its caption, .txt, as open_clip_train's
    `--val-data` reads them), a batch per shard at a time (`per_shard`)."""

    per_shard = True
    image_keys = ("jpg", "png", "jpeg", "webp")  # open_clip_train's order (and data.image_key's default)

    def read(self, sample_id: int, sample: dict, where: str) -> tuple:
        if "txt" not in sample:
            raise DatasetError(f"{where} has no caption (.txt)")
        return self.image(sample, where), sample["txt"].decode("utf-8")

    def collate(self, batch: list[tuple]) -> tuple:
        images, captions = zip(*batch)
        return torch.stack(images), list(captions)


class CaptionedImages(Dataset):
    """(image, index, captions) of image files with their captions."""

    def __init__(self, pairs: list[tuple[Path, list[str]]], transform: Callable):
        self.pairs, self.transform = pairs, transform

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple:
        from PIL import Image

        path, captions = self.pairs[index]
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), index, captions


def collate_captioned(batch: list[tuple]) -> tuple:
    images, ids, captions = zip(*batch)
    return torch.stack(images), torch.tensor(ids, dtype=torch.int64), list(captions)


def caption_lines(text: str) -> list[str]:
    """The captions of a caption file: one per non-empty line."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def read_text(path: Path) -> str:
    """A text file of a dataset (read_text_file: a regular UTF-8 file of bounded size)."""
    try:
        return read_text_file(path)
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror}") from None


def read_lines(path: Path) -> list[str]:
    return [line.strip() for line in read_text(path).splitlines() if line.strip()]


def clip_benchmark_shards(root: Path) -> Optional[list[str]]:
    """The test shards of a CLIP_benchmark webdataset (ROOT/test/nshards.txt, or ROOT/nshards.txt), or None."""
    split = next((d for d in (root / "test", root) if (d / "nshards.txt").is_file()), None)
    if split is None:
        return None
    count = read_text(split / "nshards.txt").strip()
    if not count.isdigit() or int(count) == 0:
        raise DatasetError(f"{split}/nshards.txt should hold the number of shards, not {count!r}")
    shards = [str(split / f"{i}.tar") for i in range(int(count))]
    missing = [s for s in shards if not Path(s).is_file()]
    if missing:
        raise DatasetError(f"{split}/nshards.txt names {len(shards)} shards but {missing[0]} is missing")
    return shards


def in_rounds(batches: Iterator, limit: Optional[int], rank: int, world: int, device: torch.device) -> Generator:
    """This rank's batches with the images all ranks take in that round, ending on every rank at once:
    when all ranks' batches are done or `limit` images are taken. Each round the ranks take images
    in rank order up to the limit, so the count is exact for any number of ranks and data workers;
    a rank with nothing to take gets None and runs a padding forward."""
    taken = 0
    while True:
        batch = next(batches, None)
        size = 0 if batch is None else len(batch[0])
        sizes = [size]
        if world > 1:
            gathered = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
            dist.all_gather(gathered, torch.tensor([size], dtype=torch.int64, device=device))
            sizes = torch.cat(gathered).tolist()
        left = sum(sizes) if limit is None else min(sum(sizes), limit - taken)
        if left <= 0:
            return
        share = max(0, min(size, left - sum(sizes[:rank])))
        taken += left
        yield (tuple(part[:share] for part in batch) if share and batch is not None else None), left


def gather_rows(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """This rank's rows and every other rank's, in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return rows
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(rows)], dtype=torch.int64, device=device))
    counts = torch.cat(counts).tolist()
    padded = torch.zeros((max(counts), *rows.shape[1:]), dtype=rows.dtype, device=device)
    padded[:len(rows)] = rows
    gathered = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:n] for g, n in zip(gathered, counts)])
