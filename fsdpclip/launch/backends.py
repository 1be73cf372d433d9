"""Every launcher backend: the built-in ones (torchrun on this node, Slurm, a hostfile over ssh) and any registered
since, and the one a launch's flags pick. `fsdpclip launch` looks them up here; a backend imports `launch.launcher`
(and the hostfile backend the local one, whose supervision each of its nodes runs), never this module.
Nothing here imports torch."""

from __future__ import annotations

from fsdpclip.launch import launcher
from fsdpclip.launch.hostfile import HostfileBackend
from fsdpclip.launch.launcher import LauncherBackend, LaunchFlags
from fsdpclip.launch.local import LocalBackend
from fsdpclip.launch.slurm import SlurmBackend

BUILT_IN = (LocalBackend, SlurmBackend, HostfileBackend)  # registered as their modules load


def backends() -> dict[str, type[LauncherBackend]]:
    """Every launcher backend by name: the built-in ones and any registered since."""
    return {backend.name: backend for backend in BUILT_IN} | launcher.BACKENDS


def chosen_backend(flags: LaunchFlags) -> LauncherBackend:
    """The backend `flags` picked, made for this launch."""
    return backends()[flags.backend](flags)
