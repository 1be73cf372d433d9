"""The spec's seams: data sources and tower families, each a small protocol and a registry of named implementations.

A data source or a tower family is one module that subclasses `DataSource` or `TowerFamily`, declares its
pydantic spec block (a `Section`) and calls `DATA_SOURCES.register(...)` or `TOWER_FAMILIES.register(...)`;
the built-in ones are listed once, by module name, in `BUILT_IN` (a plugin's module registers itself when
imported). The spec (`fsdpclip.spec.job`) declares the registered spec blocks, so that `validate` checks their
fields and the JSON schema shows them, and is declared again when a later registration adds one.

The registry loads the built-in modules by name the first time it is read, as entry points load plugins:
the spec sits at the bottom of the layers and cannot import them, while each implementation sits in its own
layer (a source beside the data pipeline, a family beside the model) and imports only downwards. Those
modules import nothing heavy when they load: torch, OpenCLIP and the pipeline are imported inside methods.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, Optional, TypeVar

from fsdpclip.spec.section import Section

if TYPE_CHECKING:
    from fsdpclip.problems import Report
    from fsdpclip.spec.job import Job

BUILT_IN = {
    "data source": ("fsdpclip.data.sources.webdataset", "fsdpclip.data.sources.synthetic"),
    "tower family": ("fsdpclip.model.families.timm", "fsdpclip.model.families.hf"),
}


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

    def decode(self, spec: Section, device: str) -> Optional[str]:
        """Where its images are decoded on `device` ('cpu', 'gpu', 'mixed'; `validate`'s summary), or None."""
        return None

    def waiting_hints(self, spec: Section, world_size: int, local_ranks: int, cores: Optional[int]) -> list[str]:
        """What would feed a step that waits for its batches, for `local_ranks` ranks of `world_size` on a node of
        `cores` (None: not known here), each a short clause; none by default."""
        return []

    def fingerprint(self, spec: Section) -> Optional[dict]:
        """What tells its local files apart cheaply (a resumed run keeps its saved position only while it
        is unchanged); None: nothing to compare."""
        return None


class TowerFamily:
    """Towers of one kind for the image or the text tower, given under `model.<tower>.<name>`: `config` is
    the one method to write; the others have defaults."""

    name: str  # its key under model.image / model.text
    tower: str  # 'image' or 'text'
    spec: type[Section]
    description: str = ""  # the spec field's description
    block_classes: tuple[str, ...] = ()  # its repeated blocks' class names (freeze ranges, FSDP units)
    imports: tuple[str, ...] = ()  # optional modules OpenCLIP must import to build it ('transformers')

    def config(self, spec: Section) -> dict:
        """OpenCLIP's vision_cfg or text_cfg for this tower (a ModelError for what cannot be built)."""
        raise NotImplementedError

    def load_weights(self, spec: Section, model: Any) -> None:
        """Load the tower's own initial weights (its spec's files) into `model`; default none."""

    def check(self, spec: Section, report: Report, check_paths: bool) -> None:
        """`validate`'s problems with its files, located under `model.<tower>.<name>`."""

    def paths(self, spec: Section) -> tuple[str, ...]:
        """Its fields that hold local paths (see `DataSource.paths`)."""
        return ()

    def label(self, spec: Section) -> str:
        """A short name of the tower for logs and eval output."""
        return self.name


T = TypeVar("T", DataSource, TowerFamily)


class Registry(Generic[T]):
    """The implementations of one seam by name; listeners hear of every registration."""

    def __init__(self, seam: str):
        self.seam = seam
        self._members: dict[str, T] = {}
        self._listeners: list[Callable[[], None]] = []
        self._loaded = False

    def register(self, member: T) -> T:
        """Add `member` (another of the same name replaces it) and tell the listeners."""
        self._members[member.name] = member
        self._tell()
        return member

    def unregister(self, name: str) -> None:
        """Remove the implementation called `name` and tell the listeners."""
        del self._members[name]
        self._tell()

    def _tell(self) -> None:
        for listener in self._listeners:
            listener()

    def on_register(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def members(self) -> dict[str, T]:
        """Every registered implementation by name, the built-in ones first."""
        if not self._loaded:
            self._loaded = True
            for module in BUILT_IN[self.seam]:
                importlib.import_module(module)
        return dict(self._members)

    def __getitem__(self, name: str) -> T:
        return self.members()[name]

    def __iter__(self) -> Iterator[T]:
        return iter(self.members().values())

    def specs(self) -> dict[str, type[Section]]:
        return {name: member.spec for name, member in self.members().items()}


DATA_SOURCES: Registry[DataSource] = Registry("data source")
TOWER_FAMILIES: Registry[TowerFamily] = Registry("tower family")
