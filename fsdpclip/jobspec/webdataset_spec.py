"""The webdataset source's block of the spec (`data` with `source` 'webdataset', the default): what the source
(`fsdpclip.data.sources.webdataset`) checks and the stream (`fsdpclip.data.stream`, `fsdpclip.data.batches`)
reads. No torch."""

from __future__ import annotations

import math
from typing import Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from fsdpclip.jobspec.urls import ShardPatterns
from fsdpclip.jobspec.preprocess import PreprocessSpec
from fsdpclip.jobspec.section import Section

Urls = Union[str, list[str]]


class MixedSource(Section):
    """One set of shards of a mixture (`data.sources`)."""

    urls: Urls = Field(description="Its shard URLs or paths, as `data.urls`.")
    weight: float = Field(
        default=1.0, gt=0, description="Its share of the samples drawn, relative to the other sources' weights (0.7 "
                                       "and 0.3, or 7 and 3: 70% of the samples from it).")
    samples: Optional[int] = Field(
        default=None, gt=0, description="Samples its shards hold: `data.samples` defaults to the sources' sum, and "
                                        "validate says how many passes over it an epoch reads.")
    name: Optional[str] = Field(
        default=None, min_length=1, description="Its name in metrics.jsonl's per-source counts and validate's summary "
                                                "(default: its place in the list, '0', '1', ...).")


class WebDatasetSpec(Section):
    source: Literal["webdataset"] = Field(
        default="webdataset", description="Image-text pairs from webdataset tar shards.")
    urls: Optional[Urls] = Field(
        default=None, description="Shard URLs or paths with brace expansion, e.g. 'data/train-{000000..000099}.tar'; "
                                  "at most 2^20 (1,048,576) shards in all. Give `urls` or `sources`.")
    sources: Optional[list[MixedSource]] = Field(
        default=None, min_length=1, description="Several sets of shards mixed by weight, instead of `urls`: each "
                                                "sample's source is drawn at random by the weights, and a source read "
                                                "to its end is read again (`samples` ends the epoch).")
    samples: Optional[int] = Field(
        default=None, gt=0, description="Samples in one epoch (with `sources`, default the sum of theirs); "
                                        "each rank draws samples ÷ (world size × batch.per_gpu) micro "
                                        "batches of it, rounded down.")
    resampled: bool = Field(
        default=False, description="Draw shards with replacement (infinite stream, the same epochs).")
    shuffle_buffer: int = Field(default=1000, ge=0, description="Sample shuffle buffer per worker (0: no shuffling).")
    workers: Union[int, Literal["auto"]] = Field(
        default="auto", description="DataLoader workers per rank; without `resampled` there must be at least world "
                                    "size × workers shards. 'auto': the rank's share of the node's cores less one, at "
                                    "most what its shards allow (a resumed run keeps its checkpoint's count).")
    image_key: str = Field(default="jpg;png;jpeg;webp", description="Sample keys tried for the image, ';'-separated.")
    text_key: str = Field(default="txt", description="Sample key of the caption.")
    decode: Literal["cpu", "gpu", "mixed", "auto"] = Field(
        default="auto", description="Where images are decoded and augmented: 'cpu' on the data workers, 'gpu' with "
                                    "nvJPEG on the device, 'mixed' decoded and cropped on the workers and resized on "
                                    "the device. 'auto': 'mixed' on CUDA, 'cpu' on the CPU (docs/performance.md).")
    jpeg_engines: Union[bool, Literal["auto"]] = Field(
        default="auto", description="With decode 'mixed', the GPU's hardware JPEG engines (nvImageCodec, the "
                                    "`nvimgcodec` extra) decode a share of the JPEGs, the data workers the rest. "
                                    "'auto': on CUDA where nvImageCodec is installed.")
    preprocess: PreprocessSpec = Field(
        default_factory=PreprocessSpec, description="Normalisation, evaluation resize and training augmentation, each "
                                                    "field over the model's own.")

    @field_validator("sources")
    @classmethod
    def _finite_total_weight(cls, sources: Optional[list[MixedSource]]) -> Optional[list[MixedSource]]:
        if sources and not math.isfinite(sum(source.weight for source in sources)):
            raise ValueError("the weights sum to more than a float holds (the draw needs their total): give them on "
                             "a smaller scale, as shares (0.7 and 0.3, or 7 and 3)")
        return sources

    @model_validator(mode="after")
    def _urls_or_sources(self) -> "WebDatasetSpec":
        if (self.urls is None) == (self.sources is None):
            raise ValueError("give exactly one of `urls` (one set of shards) or `sources` (several, mixed by weight)")
        if self.samples is None:
            if self.sources is None or any(s.samples is None for s in self.sources):
                raise ValueError("`samples` is missing: give the samples of an epoch (or, with `sources`, each "
                                 "source's `samples`)")
            self.samples = sum(s.samples or 0 for s in self.sources)  # each given (above)
        return self

    def settled_workers(self, world_size: int, local_ranks: int, cores: int) -> int:
        """`workers`, with 'auto' settled for a rank of `local_ranks` on a node of `cores` in a world of
        `world_size` ranks: its share of the cores less one for the rank's own process, at least 1, and (without
        `resampled`) at most the shards each rank has of its smallest source."""
        if self.workers != "auto":
            return self.workers
        workers = max(1, cores // max(1, local_ranks) - 1)
        if not self.resampled:
            try:
                shards = min(ShardPatterns(source.urls).count for source in self.mixture())
            except ValueError:  # unbalanced braces: validate says so
                return workers
            workers = min(workers, max(1, shards // max(1, world_size)))
        return workers

    def mixture(self) -> list[MixedSource]:
        """The sources to mix, named: `sources`, or `urls` as the one source (weight 1, named '0')."""
        sources = self.sources
        if sources is None:
            assert self.urls is not None  # one of the two, as validated
            sources = [MixedSource(urls=self.urls, samples=self.samples)]
        return [s.model_copy(update={"name": s.name or str(i)}) for i, s in enumerate(sources)]
