"""The webdataset source: image-text pairs from tar shards (`data.source` 'webdataset', the default).

Its spec block, `validate`'s checks of the shard URLs, the path fields `launch` resolves and the shards'
fingerprint load without torch; the stream itself (`fsdpclip.data.batches`) is imported when a rank asks
for its batches.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Optional, Union

from pydantic import Field

from fsdpclip.data.urls import MAX_SHARDS, ShardPatterns, is_local, local_path, scheme_problem, shard_urls
from fsdpclip.spec.registry import DATA_SOURCES, DataSource, RankData
from fsdpclip.spec.section import Section

if TYPE_CHECKING:
    from fsdpclip.problems import Report
    from fsdpclip.spec.job import Job

log = logging.getLogger("fsdpclip")
CHECKED_SHARDS = 1000  # at most this many shard URLs are looked at (evenly spread over a larger set)


class WebDatasetSpec(Section):
    source: Literal["webdataset"] = Field("webdataset", description="Image-text pairs from webdataset tar shards.")
    urls: Union[str, list[str]] = Field(
        description="Shard URLs or paths with brace expansion, e.g. 'data/train-{000000..000099}.tar'; at most "
                    "2^20 (1,048,576) shards.")
    samples: int = Field(
        gt=0, description="Samples in one epoch (the sum over all shards). An epoch is samples ÷ (world size × "
                          "batch.per_gpu) micro batches on every rank, rounded down, split evenly over the rank's "
                          "workers; a worker whose shards hold fewer reads them again in another order (as "
                          "OpenCLIP's with_epoch).")
    resampled: bool = Field(False, description="Draw shards with replacement (infinite stream, the same epochs).")
    shuffle_buffer: int = Field(1000, ge=0, description="Sample shuffle buffer per worker (0: no shuffling).")
    workers: int = Field(4, ge=0, description="DataLoader workers per rank; each reads its own shards, so "
                                               "without `resampled` there must be ≥ world size × workers shards.")
    image_key: str = Field("jpg;png;jpeg;webp", description="Sample keys tried for the image, ';'-separated.")
    text_key: str = Field("txt", description="Sample key of the caption.")
    decode: Literal["cpu", "gpu", "mixed", "auto"] = Field(
        "auto", description="Where images are decoded and augmented. 'cpu': on the data workers (the batch crosses "
                            "to the device as uint8 and is normalised there). 'gpu': JPEGs decoded with nvJPEG, "
                            "cropped and resized on the device ahead of the step; the workers read their headers "
                            "and draw the same crops (progressive and CMYK JPEGs and other formats are decoded on "
                            "the workers). 'mixed': the workers decode every image and cut its crop; the pinning "
                            "thread copies the crops to the device and resizes them there, ahead of the step "
                            "(nvJPEG's decode does not overlap a step that keeps the GPU busy; the crops cross "
                            "unresized, padded to the batch's largest: for "
                            "256-px JPEGs ~7× the shared memory of 'gpu' and 1.3× that of 'cpu', growing with "
                            "the images: for images near the model's size). "
                            "'auto' (the default): the path measured fastest where the run trains, 'mixed' on CUDA "
                            "(ViT-B-32 on 256-px JPEG shards, 1×H200: 0.96× the synthetic rate, against 0.73× for "
                            "'gpu' and 0.39× for 'cpu': benchmarks/results/2026-12-03-jpeg-default-1xh200.jsonl), "
                            "'cpu' on the CPU.")


class WebDatasetSource(DataSource):
    name = "webdataset"
    spec = WebDatasetSpec
    counts_epochs = True  # each worker's shards are cut into epochs (as OpenCLIP's with_epoch)

    def batches(self, spec: WebDatasetSpec, rank: RankData):
        from fsdpclip.data.batches import webdataset_batches
        from fsdpclip.data.transform import DECODED_WHERE
        from fsdpclip.model.build import image_transform

        batches, images = webdataset_batches(spec, image_transform(rank.model, train=True), rank.tokenizer,
                                             rank.batch_size, rank.rank, rank.world_size, rank.seed, rank.device)
        if rank.is_main:
            log.info("data: images decoded %s", DECODED_WHERE[images.decode])
        return batches, images

    def check(self, spec: WebDatasetSpec, job: Job, report: Report, check_paths: bool) -> None:
        """Shard URLs the reader can open (their scheme), not too many and enough of them for the ranks and
        workers, and, with `check_paths`, the local ones present: counted without expanding them, and a sample
        of CHECKED_SHARDS looked at when there are more."""
        try:
            shards = ShardPatterns(spec.urls)
        except ValueError as exc:
            report.error("data.urls", str(exc), spec.urls,
                         hint="every '{' needs its '}' (a literal one is written '\\{')")
            return
        count = shards.count
        if count > MAX_SHARDS:
            report.error("data.urls", f"{count:,} shards, more than a job may read ({MAX_SHARDS:,}: every rank "
                         "holds the list)", spec.urls,
                         hint="pack the data into fewer, larger shards, or check the brace range")
            return
        sample = shards.sample(CHECKED_SHARDS)
        of = f"{len(sample):,} checked (of {count:,})" if len(sample) < count else f"{count:,}"
        unreadable = [(u, problem) for u in sample for problem in [scheme_problem(u)] if problem]
        if unreadable:
            url, (message, hint) = unreadable[0]
            report.error("data.urls", f"{message}: {len(unreadable)} of {of} shards", url, hint=hint)
        missing = [u for u in sample if check_paths and is_local(u) and not Path(local_path(u)).is_file()]
        if missing:
            report.error("data.urls", f"{len(missing)} of {of} shards not found", missing[0],
                         hint="check the path and the brace range" if len(missing) < len(sample) else
                         "paths are relative to the directory you run fsdpclip in")
        needed = report.world_size * max(1, spec.workers)
        if not spec.resampled and count < needed:  # each worker of each rank reads shards of its own
            report.error("data.urls", f"{count} shards for {report.world_size} ranks × {max(1, spec.workers)} "
                         f"workers: some workers would get none (shards must be ≥ world size × data.workers, as "
                         f"OpenCLIP requires)", count,
                         hint=f"use ≥ {needed} shards, fewer workers, or data.resampled")

    def paths(self, spec: WebDatasetSpec) -> tuple[str, ...]:
        return ("urls",)

    def decode(self, spec: WebDatasetSpec, device: str) -> Optional[str]:
        from fsdpclip.data.transform import decode_mode

        return decode_mode(spec.decode, device)

    def fingerprint(self, spec: WebDatasetSpec) -> Optional[dict]:
        """The local shards' count and a digest of their paths, sizes and modification times (one stat
        each); None without a local shard."""
        digest, count = hashlib.sha256(), 0
        for url in shard_urls(spec.urls):
            if is_local(url):
                try:
                    found = os.stat(local_path(url))
                    digest.update(f"{url}\t{found.st_size}\t{found.st_mtime_ns}\n".encode())
                except OSError:
                    digest.update(f"{url}\tmissing\n".encode())
                count += 1
        return {"local": count, "digest": digest.hexdigest()} if count else None


DATA_SOURCES.register(WebDatasetSource())
