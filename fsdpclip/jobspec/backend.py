"""The launcher backend protocol and its registry (`fsdpclip.jobspec.registry`), and the launch command's flags.

A backend is one way to start a job, picked by its flag of `fsdpclip launch`: torchrun on this node
(`fsdpclip.launch.local`, the default: with a static rendezvous when the job spans nodes and you start each node
yourself), a Slurm batch script that starts torchrun on every node of its allocation (`fsdpclip.launch.slurm`,
`--slurm`), or torchrun on every host of a hostfile over ssh (`fsdpclip.launch.hostfile`, `--hostfile FILE`).
A backend is one module (or a plugin's) that subclasses `LauncherBackend` and ends with
`LAUNCHER_BACKENDS.register(Backend)`. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Optional

from fsdpclip.jobspec.registry import Registry
from fsdpclip.jobspec.section import Section, one_line

if TYPE_CHECKING:
    from rich.console import Console

    from fsdpclip.jobspec.job import Job

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
    """One way to start a job: the protocol every backend implements (a subclass that overrides `start`; the
    class is what `LAUNCHER_BACKENDS` holds). `fsdpclip launch` makes one per launch from its flags and calls
    `check_flags`, `overrides`, `prepare`, `forks_ranks`, `check_job` and `start` in that order; each raises
    LaunchError for the user.

    `name` is its flag (`--NAME`; the default backend's is never given), `help` that flag's help, `metavar`
    set when the flag takes a value (`flags.backend_value`), and `runs_here` true when the ranks start on
    this node (which `launch` checks first: GPUs, the rendezvous port, a run already finished). `spec`, where
    it has settings in the spec, is their block under `launch.NAME` (always there: its defaults where not
    given), described by `description`."""

    name: ClassVar[str]
    help: ClassVar[str]
    metavar: ClassVar[Optional[str]] = None
    runs_here: ClassVar[bool] = False
    spec: ClassVar[Optional[type[Section]]] = None
    description: ClassVar[str] = ""

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

    def forks_ranks(self) -> bool:
        """Whether the ranks are to be forked from this launcher (known after `prepare`); then the spec's checks run
        in a fork of their own, so that nothing they do to the process reaches the ranks."""
        return False

    def check_job(self, job: Job) -> None:
        """What this backend cannot do with a valid job (its nodes, say)."""

    def start(self, job: Job, console: Console) -> Optional[dict]:
        """Start the job with resolved paths (with `flags.dry_run`: only print what would run). Returns the exit
        report of a run it waited for (exit.json's record), None where it only printed or submitted."""
        raise NotImplementedError

    @classmethod
    def paths(cls, spec: Section) -> tuple[str, ...]:
        """The fields of its block that hold local paths (see `jobspec.source.DataSource.paths`)."""
        return ()


LAUNCHER_BACKENDS: Registry[type[LauncherBackend]] = Registry(
    "launcher backend", ("fsdpclip.launch.local", "fsdpclip.launch.slurm", "fsdpclip.launch.hostfile"))
