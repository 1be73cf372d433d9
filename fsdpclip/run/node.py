"""What this node has for its ranks: cores and memory (no torch)."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def local_ranks() -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))


def cores_per_local_rank() -> int:
    """This rank's share of the node's cores, at least 1."""
    return max(1, usable_cores() // local_ranks())


def host_memory() -> int:
    """Bytes of memory this node has."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
