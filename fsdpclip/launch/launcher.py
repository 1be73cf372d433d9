"""What every way of starting a job shares: the launch command's flags, the launcher backend protocol and
its registry, the job's paths made absolute, and torchrun's command line.

A backend (`LauncherBackend`) is one way to start a job, picked by its flag of `fsdpclip launch`: torchrun on
this node (`fsdpclip.launch.local`, the default: with a static rendezvous when the job spans nodes and you
start each node yourself), a Slurm batch script that starts torchrun on every node of its allocation
(`fsdpclip.launch.slurm`, `--slurm`), or torchrun on every host of a hostfile over ssh
(`fsdpclip.launch.hostfile`, `--hostfile FILE`). A backend registers itself with `register_backend`;
`fsdpclip.launch.backends` lists the built-in ones and any registered since. Nothing here imports torch.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Optional

from fsdpclip.data.urls import is_local
from fsdpclip.spec.job import Job, one_line
from fsdpclip.spec.registry import DATA_SOURCES

if TYPE_CHECKING:
    from rich.console import Console

TRAIN_MODULE = "fsdpclip.train.entry"
TORCHRUN = "fsdpclip.launch.torchrun"  # torchrun, without a traceback for the trainer's deliberate exits
DEFAULT_BACKEND = "local"


class LaunchError(Exception):
    """A launch that cannot go ahead as asked (message meant for the user)."""


@dataclass(frozen=True)
class LaunchFlags:
    """What `fsdpclip launch` was asked on its command line, beside the spec. `backend` names the backend its
    flag picked; `backend_value` is that flag's value, for a backend whose flag takes one; `include` and
    `exclude` pick hosts and slots of a hostfile."""

    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    backend: str = DEFAULT_BACKEND
    partition: Optional[str] = None
    time_limit: Optional[str] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    dry_run: bool = False
    backend_value: Optional[str] = None
    include: Optional[str] = None
    exclude: Optional[str] = None

    def check(self) -> None:
        """Flag values that cannot be written into a launch (any backend); the backend checks the rest."""
        for flag, value in (("--partition", self.partition), ("--time", self.time_limit)):
            try:
                one_line(value or "")
            except ValueError as exc:
                raise LaunchError(f"{flag} {value!r}: {exc}") from None

    def overrides(self) -> list[str]:
        """The flags that set spec fields, as `--set` assignments."""
        fields = {"launch.nodes": self.nodes, "launch.gpus_per_node": self.gpus_per_node,
                  "launch.master_port": self.master_port, "launch.slurm.partition": self.partition,
                  "launch.slurm.time": self.time_limit}
        return [f"{key}={json.dumps(value)}" for key, value in fields.items() if value is not None]


class LauncherBackend:
    """One way to start a job: the protocol every backend implements (a subclass that overrides `start`,
    decorated with `register_backend`). `fsdpclip launch` makes one per launch from its flags and calls
    `check_flags`, `overrides`, `prepare`, `check_job` and `start` in that order; each raises LaunchError for
    the user.

    `name` is its flag (`--NAME`; the default backend's is never given), `help` that flag's help, `metavar`
    set when the flag takes a value (`flags.backend_value`), and `runs_here` true when the ranks start on
    this node (which `launch` checks first: GPUs, the rendezvous port, a run already finished)."""

    name: ClassVar[str]
    help: ClassVar[str]
    metavar: ClassVar[Optional[str]] = None
    runs_here: ClassVar[bool] = False

    def __init__(self, flags: LaunchFlags):
        self.flags = flags

    def check_flags(self) -> None:
        """Flags this backend cannot honour, before the spec is read."""

    def overrides(self) -> list[str]:
        """Spec fields this backend sets (a hostfile's nodes, say), as `--set` assignments applied after the
        command line's."""
        return []

    def prepare(self, job: Job) -> None:
        """Work that must come before torch is imported (the spec's checks import it)."""

    def check_job(self, job: Job) -> None:
        """What this backend cannot do with a valid job (its nodes, say)."""

    def start(self, job: Job, console: "Console") -> Optional[dict]:
        """Start the job with resolved paths (with `flags.dry_run`: only print what would run). Returns the exit
        report of a run it waited for (exit.json's record), None where it only printed or submitted."""
        raise NotImplementedError


BACKENDS: dict[str, type[LauncherBackend]] = {}


def register_backend(backend: type[LauncherBackend]) -> type[LauncherBackend]:
    """Make a backend a flag of `fsdpclip launch` (a class decorator)."""
    if backend.name in BACKENDS and BACKENDS[backend.name] is not backend:
        raise ValueError(f"a launcher backend named {backend.name!r} is registered already")
    BACKENDS[backend.name] = backend
    return backend


def resolve_paths(job: Job, base: Path) -> Job:
    """The job with every local path made absolute (relative ones are relative to `base`)."""

    def absolute(path: Optional[str]) -> Optional[str]:
        return None if path is None else str((base / path).resolve()) if is_local(path) else path

    def resolve_fields(block, names: tuple[str, ...]) -> None:  # a path, a list of them, or another value
        for name in names:
            blocks, _, field = name.partition("[].")
            if field:  # that field of each block in a list
                for item in getattr(block, blocks) or []:
                    resolve_fields(item, (field,))
                continue
            value = getattr(block, name)
            setattr(block, name, absolute(value) if isinstance(value, str) else
                    [absolute(v) for v in value] if isinstance(value, list) else value)

    data = job.model_copy(deep=True)
    data.run.output_dir = absolute(job.run.output_dir)
    model = data.model
    model.config = absolute(model.config)
    model.pretrained = model.pretrained if model.published_tag else absolute(model.pretrained)
    model.image.pretrained, model.text.pretrained = absolute(model.image.pretrained), absolute(model.text.pretrained)
    for family, block in filter(None, (model.image.family, model.text.family)):
        resolve_fields(block, family.paths(block))
    resolve_fields(data.data, DATA_SOURCES[data.data.source].paths(data.data))
    for zs in data.eval.zeroshot:
        zs.path, zs.classnames = absolute(zs.path), absolute(zs.classnames)
        if zs.templates not in (None, "openai", "simple"):
            zs.templates = absolute(zs.templates)
    for retrieval in data.eval.retrieval:
        retrieval.path = absolute(retrieval.path)
    if data.checkpoint.resume not in (None, "latest"):
        data.checkpoint.resume = absolute(data.checkpoint.resume)
    return data


def render(command: list[str]) -> str:
    """A command line as the shell reads it."""
    return " ".join(shlex.quote(part) for part in command)

