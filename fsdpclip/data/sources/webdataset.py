"""The webdataset source: image-text pairs from tar shards (`data.source` 'webdataset', the default).

Its spec block (`fsdpclip.jobspec.webdataset_spec`, which the stream reads too), `validate`'s checks of the shard
URLs, the path fields `launch` resolves and the shards' fingerprint load without torch; the stream itself
(`fsdpclip.data.batches`) is imported when a rank asks for its batches.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

from fsdpclip.jobspec.urls import MAX_SHARDS, ShardPatterns, is_local, local_path, scheme_problem, shard_urls
from fsdpclip.jobspec.webdataset_spec import WebDatasetSpec
from fsdpclip.run.node import usable_cores
from fsdpclip.jobspec.source import DATA_SOURCES, DataSource, RankData

if TYPE_CHECKING:
    from fsdpclip.jobspec.problems import Report
    from fsdpclip.jobspec.job import Job

log = logging.getLogger("fsdpclip")
CHECKED_SHARDS = 1000  # at most this many shard URLs are looked at (evenly spread over a larger set)


class WebDatasetSource(DataSource):
    name = "webdataset"
    spec = WebDatasetSpec
    counts_epochs = True  # each worker's shards are cut into epochs (as OpenCLIP's with_epoch)

    def batches(self, spec: WebDatasetSpec, rank: RankData):
        from fsdpclip.data.batches import webdataset_batches
        from fsdpclip.data.transform import DECODED_WHERE
        from fsdpclip.model.build import image_transform

        batches, images = webdataset_batches(spec, rank.settled, image_transform(rank.model, train=True),
                                             rank.tokenizer, rank.batch_size, rank.rank, rank.world_size, rank.seed,
                                             rank.device)
        if rank.is_main:
            log.info("data: images decoded %s", DECODED_WHERE[images.decode + ("+engines" if batches.engines else "")])
            if mixture := self.describe(spec):
                log.info("data: %s", mixture)
        return batches, images

    def check(self, spec: WebDatasetSpec, job: Job, report: Report, check_paths: bool) -> None:
        """Each source's shard URLs (`_check_urls`), not too many in all, and a mixture's source names
        given once each."""
        total = 0
        for index, source in enumerate(spec.mixture()):
            where = "data.urls" if spec.sources is None else f"data.sources[{index}].urls"
            total += self._check_urls(source.urls, where, spec, report, check_paths)
        self._check_engines(spec, job, report)
        if spec.sources is None:
            return
        if total > MAX_SHARDS:
            report.error("data.sources", f"{total:,} shards in all, more than a job may read ({MAX_SHARDS:,}: every "
                         "rank holds the list)", total, hint="pack the data into fewer, larger shards")
        names = set()
        for index, source in enumerate(spec.mixture()):
            if source.name in names:
                report.error(f"data.sources[{index}].name", f"a second source named '{source.name}'", source.name,
                             hint="give each source a name of its own (one without is named by its place: '0', "
                                  "'1', ...)")
            names.add(source.name)

    def _check_engines(self, spec: WebDatasetSpec, job: Job, report: Report) -> None:
        """`jpeg_engines: true` where they have a share to take: decode 'mixed', nvImageCodec installed."""
        from fsdpclip.data.engines import missing
        from fsdpclip.data.transform import decode_mode

        if spec.jpeg_engines is not True:
            return
        mode = decode_mode(spec.decode, job.launch.device)
        if mode != "mixed":
            report.error("data.jpeg_engines", f"the JPEG engines take a share of decode 'mixed', but this run's images "
                         f"are decoded '{mode}'", True, hint="data.decode 'mixed', or data.jpeg_engines 'auto'")
        elif reason := missing():  # imported: where the launcher forks its ranks, its checks run in a fork
            report.error("data.jpeg_engines", reason, True, hint="data.jpeg_engines 'auto' decodes every JPEG on the "
                         "data workers where nvImageCodec is missing")

    def _check_urls(self, urls: Union[str, list[str]], where: str, spec: WebDatasetSpec, report: Report,
                    check_paths: bool) -> int:
        """Shard URLs the reader can open (`check_shard_urls`), enough of them for the ranks and workers, and, with
        `check_paths`, the local ones present (`check_local_shards`). Returns how many there are (0 where they
        cannot be counted or are too many to look at)."""
        shards = check_shard_urls(urls, where, report)
        if shards is None:
            return 0
        if check_paths:
            check_local_shards(shards, where, report)
        count = shards.count
        workers = max(1, spec.settled_workers(report.world_size, report.gpus_per_node, usable_cores()))
        needed = report.world_size * workers
        if not spec.resampled and count < needed:  # each worker of each rank reads shards of its own
            report.error(where, f"{count} shards for {report.world_size} ranks × {workers} "
                         f"workers: some workers would get none (shards must be ≥ world size × data.workers, as "
                         f"OpenCLIP requires)", count,
                         hint=f"use ≥ {needed} shards, fewer workers, or data.resampled")
        return count

    def paths(self, spec: WebDatasetSpec) -> tuple[str, ...]:
        return ("urls", "sources[].urls")

    def describe(self, spec: WebDatasetSpec) -> Optional[str]:
        """A mixture's sources: each one's name, share of the samples and shards, and the passes over it an
        epoch reads where its samples are given."""
        if spec.sources is None:
            return None
        assert spec.samples is not None  # the sources' sum where not given (validated)
        mixture, total = spec.mixture(), sum(source.weight for source in spec.sources)
        parts = []
        for source in mixture:
            try:
                shards = f"{ShardPatterns(source.urls).count:,} shards"
            except ValueError:
                shards = "shards not counted"
            share = source.weight / total
            if source.samples:
                shards += f", {spec.samples * share / source.samples:.2g} passes an epoch"
            parts.append(f"'{source.name}' {share:.1%} ({shards})")
        return f"{len(mixture)} sources mixed by weight: " + ", ".join(parts)

    def plan(self, spec: WebDatasetSpec, device: str, world_size: int, local_ranks: int,
             cores: Optional[int]) -> dict:
        """`decode` (`transform.decode_mode`), `jpeg_engines` (`engines.engines_on`, for decode 'mixed') and, where
        the cores are known, `workers` (`settled_workers`)."""
        from fsdpclip.data.engines import engines_on
        from fsdpclip.data.transform import decode_mode

        decode = decode_mode(spec.decode, device)
        settled = {"decode": decode, "jpeg_engines": decode == "mixed" and engines_on(spec.jpeg_engines, device)}
        if cores is not None:
            settled["workers"] = spec.settled_workers(world_size, local_ranks, cores)
        return settled

    def prepare_rank(self, spec: WebDatasetSpec, device: str) -> None:
        """Where the JPEG engines take a share (`plan`), the data workers start from a fork server, which imports
        torch and OpenCLIP before it forks any: started here, it loads while the rank starts, rather than while
        the rank waits for its first workers."""
        from fsdpclip.data.engines import worker_context

        if spec.workers != 0 and self.plan(spec, device, 1, 1, None)["jpeg_engines"]:
            worker_context(engines=True)

    def waiting_hints(self, spec: WebDatasetSpec, world_size: int, local_ranks: int,
                      cores: Optional[int]) -> list[str]:
        """More data workers where the node has spare cores, the workers' crops resized on the device where they
        also resize, and shards of images resized near the model's size."""
        hints = []
        if spec.workers != "auto" and (cores is None or spec.workers < cores // max(1, local_ranks) - 1):
            hints.append(f"data.workers 'auto' (one per core of the rank's share, less one; now {spec.workers})")
        if spec.decode == "cpu":
            hints.append("data.decode 'auto' (the workers decode and crop, the GPU resizes)")
        hints.append("shards of smaller images: fsdpclip data resize SHARDS OUT --size N (N: about 1.15 × the "
                     "model's image size)")
        return hints

    def fingerprint(self, spec: WebDatasetSpec) -> Optional[dict]:
        """The local shards' count and a digest of their paths, sizes and modification times (one stat
        each); None without a local shard."""
        digest, count = hashlib.sha256(), 0
        for url in (url for source in spec.mixture() for url in shard_urls(source.urls)):
            if is_local(url):
                try:
                    found = os.stat(local_path(url))
                    digest.update(f"{url}\t{found.st_size}\t{found.st_mtime_ns}\n".encode())
                except OSError:
                    digest.update(f"{url}\tmissing\n".encode())
                count += 1
        return {"local": count, "digest": digest.hexdigest()} if count else None


def check_shard_urls(urls: Union[str, list[str]], where: str, report: Report) -> Optional[ShardPatterns]:
    """Shard URLs the reader can open (their scheme) and no more than a job may read, counted without expanding
    them, and a sample of CHECKED_SHARDS looked at when there are more. Returns them, or None where they cannot
    be counted (unbalanced braces) or are too many to look at."""
    try:
        shards = ShardPatterns(urls)
    except ValueError as exc:
        report.error(where, str(exc), urls, hint="every '{' needs its '}' (a literal one is written '\\{')")
        return None
    if shards.count > MAX_SHARDS:
        report.error(where, f"{shards.count:,} shards, more than a job may read ({MAX_SHARDS:,}: every rank holds "
                     "the list)", urls, hint="pack the data into fewer, larger shards, or check the brace range")
        return None
    sample = shards.sample(CHECKED_SHARDS)
    unreadable = [(u, problem) for u in sample for problem in [scheme_problem(u)] if problem]
    if unreadable:
        url, (message, hint) = unreadable[0]
        report.error(where, f"{message}: {len(unreadable)} of {_of(sample, shards)} shards", url, hint=hint)
    return shards


def check_local_shards(shards: ShardPatterns, where: str, report: Report) -> None:
    """The local shards among a sample of CHECKED_SHARDS (all of them where there are no more) present."""
    sample = shards.sample(CHECKED_SHARDS)
    missing = [u for u in sample if is_local(u) and not Path(local_path(u)).is_file()]
    if missing:
        report.missing(where, f"{len(missing)} of {_of(sample, shards)} shards not found", missing[0],
                       hint="check the path and the brace range" if len(missing) < len(sample) else None)


def _of(sample: list[str], shards: ShardPatterns) -> str:
    """How many shards were looked at: '1,000 checked (of 5,000)', or their count where all were."""
    return f"{len(sample):,} checked (of {shards.count:,})" if len(sample) < shards.count else f"{shards.count:,}"


DATA_SOURCES.register(WebDatasetSource())
