"""The data source protocol and its registry: training data named by `data.source` (`fsdpclip.jobspec.registry`).

A data source is one module (`data/sources/NAME.py`, or a plugin's) that subclasses `DataSource`, declares its
block under `data` (a `Section` with `source: Literal[NAME]`) and ends with `DATA_SOURCES.register(Source())`.
Its module imports nothing heavy when it loads: torch and the pipeline are imported inside its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from fsdpclip.jobspec.registry import Registry
from fsdpclip.jobspec.section import Section

if TYPE_CHECKING:
    from fsdpclip.jobspec.problems import Report
    from fsdpclip.jobspec.job import Job


@dataclass
class RankData:
    """What a data source makes one rank's batches for: the model (its shapes and preprocessing; the
    meta-device model will do), its tokenizer, the micro batch, the rank and the device."""

    model: Any
    tokenizer: Callable
    batch_size: int
    rank: int
    world_size: int
    seed: int
    device: Any
    is_main: bool = False
    settled: dict[str, Any] = field(default_factory=dict)  # the block's 'auto' settled by the run plan (`plan`)


class DataSource:
    """Training data named by `data.source`. `batches` is the one method to write; the others have defaults.

    The batches it returns are iterated by the trainer for (images, texts) micro batches and also give
    `state_dict`/`load_state_dict` (the position a checkpoint keeps), `restart(micro_batches, epoch)` (where a
    stream without a usable saved position starts), `start()`, `close()` and `broken` (samples skipped so far),
    and may give `source_samples` (samples given out so far by source name, for metrics.jsonl),
    `jpeg_engine_share` (logged) and `supply_waited(waited, elapsed, micro_batches)` (the step's wait for them,
    after each log window)."""

    name: str  # the `data.source` value that selects it
    spec: type[Section]  # its block under `data`, with `source: Literal[name]`
    counts_epochs = False  # its stream ends every `data.samples`, even where `schedule.steps` gives the length

    def batches(self, spec: Section, rank: RankData) -> tuple[Any, Optional[Callable]]:
        """One rank's batches, and what turns a batch's images into the model's input on the device (None:
        they are that already)."""
        raise NotImplementedError

    def check(self, spec: Section, job: Job, report: Report, check_paths: bool) -> None:
        """`validate`'s problems with this block, located under `data` (`check_paths`: files exist here)."""

    def paths(self, spec: Section) -> tuple[str, ...]:
        """Its fields that hold local paths (a string or a list of them; `name[].field`: that field of each
        block in the list `name`): `fsdpclip launch` makes them absolute; a relative one starts at the directory
        fsdpclip runs in."""
        return ()

    def describe(self, spec: Section) -> Optional[str]:
        """What `validate`'s summary says of the data in a line (None: nothing)."""
        return None

    def plan(self, spec: Section, device: str, world_size: int, local_ranks: int,
             cores: Optional[int]) -> dict[str, Any]:
        """Its block's 'auto' fields settled for ranks on `device`, `local_ranks` of `world_size` on a node of
        `cores` (None: not known there): what the run plan records and `batches` gets (`RankData.settled`); a
        `decode` among them ('cpu', 'gpu', 'mixed') is where its images are decoded. None by default."""
        return {}

    def waiting_hints(self, spec: Section, world_size: int, local_ranks: int, cores: Optional[int]) -> list[str]:
        """What would feed a step that waits for its batches, for `local_ranks` ranks of `world_size` on a node of
        `cores` (None: not known here), each a short clause; none by default."""
        return []

    def prepare_rank(self, spec: Section, device: str) -> None:
        """Work a rank on `device` sets going as it starts, before its process group forms, so that it overlaps the
        rank's start-up (processes that load for seconds); nothing by default."""

    def fingerprint(self, spec: Section) -> Optional[dict]:
        """What tells its local files apart cheaply (a resumed run keeps its saved position only while it
        is unchanged); None: nothing to compare."""
        return None


DATA_SOURCES: Registry[DataSource] = Registry(
    "data source", ("fsdpclip.data.sources.webdataset", "fsdpclip.data.sources.synthetic"))
