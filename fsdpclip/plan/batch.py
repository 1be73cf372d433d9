"""`batch.per_gpu: "auto"`: the search for the largest per-GPU batch whose step fits, the batch it keeps, and
the record a relaunch reuses.

The search is a function of a probe, `fits(per_gpu) -> bool` (on the GPU: a few real steps, agreed over the
ranks), so that it runs here without one. It starts from the memory model's estimate, doubles while probes
fit and halves while they do not, then bisects until the largest fit is known within 1/16 (finer costs
probes that the safety margin throws away). The batch kept is SAFETY of the largest that fit, rounded down
to a multiple of 8; with `batch.global_batch`, the largest divisor of the per-rank share below that, the
rest made up by accumulation.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from fsdpclip.run.directory import AUTO_BATCH_FILE
from fsdpclip.run.files import read_text_file, write_atomically
from fsdpclip.spec.job import Job

if TYPE_CHECKING:
    from fsdpclip.plan.mesh import MemoryModel

SAFETY = 0.9  # of the largest batch that fit: room for fragmentation, longer captions, evaluation, a CUDA graph
MAX_PER_GPU = 2 ** 15  # the search's ceiling without a global batch (or `data.samples` per rank)


@dataclass
class Probe:
    """One probe of the search: its batch, whether it fit on every rank, its peak and time on rank 0."""

    per_gpu: int
    fits: bool
    peak_gib: Optional[float] = None
    seconds: Optional[float] = None


def largest_fitting(fits: Callable[[int], bool], start: int, limit: int) -> int:
    """The largest batch in [1, limit] that `fits` (0: not even 1), searched from `start`. `fits` must be
    monotone (a batch fits when a larger one does)."""
    start = max(1, min(start, limit))
    if fits(start):
        low, high = start, None
        while low < limit and high is None:
            larger = min(2 * low, limit)
            low, high = (larger, None) if fits(larger) else (low, larger)
        if high is None:
            return low
    else:
        low, high = 0, start
        while low == 0 and high > 1:
            smaller = high // 2
            low, high = (smaller, high) if fits(smaller) else (0, smaller)
        if low == 0:
            return 0
    while high - low > max(1, low // 16):
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def kept_batch(largest: int, world: int, global_batch: Optional[int], grad_accum: int) -> tuple[int, int]:
    """(per_gpu, grad_accum) kept from the largest batch that fit: SAFETY of it, a multiple of 8 where that
    is at least 8; with `global_batch`, the largest divisor of its per-rank share under that, and the
    accumulation that makes the global batch (else the spec's `grad_accum`)."""
    under = max(1, int(largest * SAFETY))
    if global_batch is None:
        return (under // 8 * 8 if under >= 8 else under), grad_accum
    share = global_batch // world
    per_gpu = largest_divisor(share, under)
    return per_gpu, share // per_gpu


def largest_divisor(number: int, bound: int) -> int:
    """The largest divisor of `number` that is at most `bound` (1 at least)."""
    return max(d for d in range(1, max(1, min(bound, number)) + 1) if number % d == 0)


def search_limit(job: Job, world: int) -> int:
    """The largest per-GPU batch worth probing: the per-rank share of the global batch, else MAX_PER_GPU and
    no more than an epoch of `data.samples` gives each rank."""
    if job.batch.global_batch is not None:
        return job.batch.global_batch // world
    samples = job.data.samples
    return max(1, min(MAX_PER_GPU, samples // world)) if samples else MAX_PER_GPU


def search_start(memory: "MemoryModel", job: Job, world: int, degree: int, capacity: float) -> int:
    """Where the search starts (and what `validate` shows): the memory model's largest batch whose estimated peak
    fits `capacity` bytes, up to `search_limit`, counting the accumulation's cached features where it accumulates."""
    accumulates = job.batch.global_batch is not None or job.batch.grad_accum > 1
    return memory.largest_batch(world, degree, capacity, search_limit(job, world), 2 if accumulates else 1)


def micro_batches_probed(job: Job, world: int, per_gpu: int) -> int:
    """Micro batches a probe runs: 2 where the step will accumulate (the accumulation's cached features and
    its second forward), else 1."""
    accum = job.batch.global_batch // (world * per_gpu) if job.batch.global_batch else job.batch.grad_accum
    return 2 if accum > 1 else 1


@dataclass
class BatchRecord:
    """What the search chose (RUN_DIR/auto_batch.json), and what it was chosen for: a relaunch whose
    `basis` differs (model, freeze, precision and sharding, loss, the batch block, world size, GPU) searches
    again."""

    per_gpu: int
    grad_accum: int
    searched_s: float
    start: int
    basis: dict
    probes: list[Probe] = field(default_factory=list)

    def save(self, run_dir: Path) -> None:
        write_atomically(Path(run_dir) / AUTO_BATCH_FILE, json.dumps(asdict(self), indent=2) + "\n")


def search_basis(job: Job, world: int, device: str) -> dict:
    """What makes a recorded batch reusable: the spec's sections that change a step's memory, the world size
    and the GPU (its name and memory)."""
    spec = json.loads(job.to_json())
    return {"spec": {key: spec[key] for key in ("model", "freeze", "fsdp", "loss", "batch")},
            "data_samples": spec["data"].get("samples"), "world_size": world, "device": device}


def recorded_batch(run_dir: Path, basis: dict) -> Optional[BatchRecord]:
    """The record of an earlier launch of this run when it was made for `basis`, else None (none, unreadable,
    or made for another spec, world or GPU)."""
    try:
        saved = json.loads(read_text_file(Path(run_dir) / AUTO_BATCH_FILE))
        record = BatchRecord(**{**saved, "probes": [Probe(**p) for p in saved.get("probes", [])]})
    except (OSError, ValueError, TypeError):
        return None
    return record if record.basis == basis else None
