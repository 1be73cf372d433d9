"""The synthetic source: random images and token ids made on the device (`data.source` 'synthetic'; benchmarks).

No decode and no host work. Batch `index` of rank `rank` depends only on (seed, index, rank), so any world
size can rebuild another's global batch. torch is imported inside the methods that make batches.
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from fsdpclip.jobspec.source import DATA_SOURCES, DataSource, RankData
from fsdpclip.jobspec.section import Section


class SyntheticSpec(Section):
    source: Literal["synthetic"] = Field(description="Random images and tokens generated on the device (benchmarks).")
    samples: Optional[int] = Field(
        default=None, gt=0, description="Samples in one epoch (needed only with `schedule.epochs`).")



class SyntheticBatches:
    """Random (images, texts) micro batches of one rank, made on the device."""

    def __init__(self, image_shape: tuple[int, int, int], context: int, vocab: int, batch_size: int,
                 device, seed: int, rank: int):
        self.image_shape, self.context, self.vocab = image_shape, context, vocab
        self.batch_size, self.device, self.seed, self.rank = batch_size, device, seed, rank
        self.index = 0
        self.broken = 0  # samples skipped: none here

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]

    def restart(self, micro_batches: int, epoch: int) -> None:
        """Start at batch `micro_batches` (the stream has no epochs)."""
        self.index = micro_batches

    def start(self) -> None:
        """Nothing to start ahead: batches are made when asked for."""

    def close(self) -> None:
        """Nothing to stop."""

    def batch(self, index: int, rank: Optional[int] = None):
        import torch

        generator = torch.Generator(device=self.device)
        generator.manual_seed(hash((self.seed, index, self.rank if rank is None else rank)) & (2 ** 62 - 1))
        images = torch.randn(self.batch_size, *self.image_shape, generator=generator, device=self.device)
        texts = torch.randint(1, self.vocab, (self.batch_size, self.context), generator=generator, device=self.device)
        return images, texts

    def __iter__(self):
        while True:
            self.index += 1
            yield self.batch(self.index - 1)


class SyntheticSource(DataSource):
    name = "synthetic"
    spec = SyntheticSpec

    def batches(self, spec: SyntheticSpec, rank: RankData):
        from fsdpclip.model.build import image_shape, text_shape

        context, vocab = text_shape(rank.model)
        return SyntheticBatches(image_shape(rank.model), context, vocab, rank.batch_size, rank.device, rank.seed,
                                rank.rank), None


DATA_SOURCES.register(SyntheticSource())
