"""`batch.per_gpu: "auto"`: the search for the largest per-GPU batch whose step fits, the batch it keeps, and
the record a relaunch reuses.

The search is a function of a probe, `probe(per_gpu) -> (fits, peak_bytes)` (on the GPU: a real step, agreed
over the ranks), so that it runs here without one. Two searches, as the probe can recover from running out of
memory or not (`settled_batch`):

- recovering (FSDP's `reset_iter_state`): from the memory model's estimate, double while probes fit and halve
  while they do not, then bisect until the largest fit is known within 1/16 (finer costs probes that the
  safety margin throws away);
- predicted, where nothing may run out of memory: grow from half the estimate only to batches the measured
  peaks predict under PEAK_MARGIN of the device's memory (at most doubling), until growth is within 1/16;
  the batch kept is then confirmed by one probe, and an out-of-memory probe ends the search with the
  batch that failed and the largest that fit.

The batch kept is SAFETY of the largest that fit (or was predicted to), rounded down to a multiple of 8;
with `batch.global_batch`, the largest divisor of the per-rank share below that, the rest made up by
accumulation.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

from fsdpclip.run.directory import AUTO_BATCH_FILE
from fsdpclip.run.files import read_text_file, write_atomically
from fsdpclip.jobspec.job import Job, largest_divisor

if TYPE_CHECKING:
    from fsdpclip.plan.mesh import MemoryModel

SAFETY = 0.9  # of the largest batch that fit: room for fragmentation, longer captions, evaluation, a CUDA graph
MAX_PER_GPU = 2 ** 15  # the search's ceiling without a global batch (or `data.samples` per rank)
# Of the device's memory, the most a predicted peak may reach: the allocator's fragmentation, what its peak
# statistics do not count (the CUDA context, NCCL's buffers) and the line's error where it extrapolates.
PEAK_MARGIN = 0.9

ProbeFn = Callable[[int], tuple[bool, float]]  # per_gpu -> (fits on every rank, the largest peak in bytes)


class BatchSearchFailed(Exception):
    """No batch to keep: nothing fits, or a probe ran out of memory where the search cannot go on after it."""


@dataclass
class Probe:
    """One probe of the search: its batch, whether it fit on every rank, its largest peak over the ranks and its
    time on rank 0."""

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


def settled_batch(probe: ProbeFn, job: Job, world: int, start: int, budget: Optional[float]) -> tuple[int, int]:
    """(per_gpu, grad_accum) for `job` on `world` ranks, searched from `start`: with `budget` None the probe
    recovers from running out of memory (`largest_fitting`), else every batch probed is predicted to peak
    under `budget` bytes (`largest_predicted`) and the one kept is confirmed by a probe. Raises
    BatchSearchFailed where nothing fits or a probe of the predicted search runs out of memory."""
    limit = search_limit(job, world)
    if budget is None:
        largest = largest_fitting(lambda per_gpu: probe(per_gpu)[0], start, limit)
    else:
        largest, largest_fit = largest_predicted(probe, start, limit, budget)
    if largest == 0:
        raise BatchSearchFailed("batch.per_gpu 'auto': not even one sample per GPU fits a step "
                                "(more GPUs, activation checkpointing or CPU offload)")
    per_gpu, accum = kept_batch(largest, world, job.batch.global_batch, job.batch.grad_accum)
    if budget is not None and not probe(per_gpu)[0]:
        raise out_of_memory(per_gpu, largest_fit)
    return per_gpu, accum


def largest_predicted(probe: ProbeFn, start: int, limit: int, budget: float) -> tuple[int, int]:
    """The largest batch in [0, limit] whose peak the probes that fit predict under `budget` bytes, and the
    largest probed that fit. Only batches so predicted are probed, but the first: half of `start`, the memory
    model's largest under the whole device. Each probe grows the batch to the largest predicted, at most
    doubling it, until it would grow by 1/16 or less (after the first, by nothing). Raises BatchSearchFailed
    when a probe runs out of memory."""
    batch, fitted = max(1, min(start, limit) // 2), []
    while True:
        fits, peak = probe(batch)
        if not fits:
            raise out_of_memory(batch, fitted[-1][0] if fitted else 0)
        fitted.append((batch, peak))
        largest = largest_under(fitted, budget, limit)
        larger = min(largest, 2 * batch)
        if larger <= batch + (batch // 16 if len(fitted) > 1 else 0):  # one point's line is only a bound
            return largest, batch
        batch = larger


def largest_under(fitted: list[tuple[int, float]], budget: float, limit: int) -> int:
    """The largest batch in [0, limit] whose peak the line through the two largest fitted (batch, peak) points
    predicts at most `budget` (one point: the line through the origin, which bounds the peaks above it where
    memory has a fixed part). The two largest rather than a least-squares line over all: at small batches the
    peak may be the optimizer step's, flat in the batch, which would flatten the line."""
    (low, low_peak), (high, peak) = ([(0, 0.0)] + sorted(fitted))[-2:]
    slope = max(0.0, (peak - low_peak) / (high - low))
    if slope == 0.0:
        return limit if peak <= budget else 0
    return max(0, min(limit, high + math.floor((budget - peak) / slope)))


def out_of_memory(batch: int, largest_fit: int) -> BatchSearchFailed:
    """The one line of a probe that ran out of memory where FSDP cannot recover from it to probe again."""
    fit = f"the largest that fit: {largest_fit}" if largest_fit else "none fit"
    return BatchSearchFailed(f"batch.per_gpu 'auto': a step of {batch} per GPU ran out of memory ({fit}), and "
                             "this torch's FSDP cannot recover from that to probe again: set batch.per_gpu")


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
    """What makes a recorded batch reusable: the spec's sections that change a step's memory and the memory
    `launch.gpu_memory_gib` allows, the world size, the GPU (its name and memory) and torch's version (its kernels
    and allocator)."""
    import torch  # what the ranks run, which a search has imported already

    spec = json.loads(job.to_json())
    return {"spec": {key: spec[key] for key in ("model", "freeze", "fsdp", "loss", "batch", "ema")},
            "gpu_memory_gib": spec["launch"].get("gpu_memory_gib"), "data_samples": spec["data"].get("samples"),
            "world_size": world, "device": device, "torch": torch.__version__}


def recorded_batch(run_dir: Path, basis: dict) -> Optional[BatchRecord]:
    """The record of an earlier launch of this run when it was made for `basis`, else None (none, unreadable,
    or made for another spec, world or GPU)."""
    try:
        saved = json.loads(read_text_file(Path(run_dir) / AUTO_BATCH_FILE))
        record = BatchRecord(**{**saved, "probes": [Probe(**p) for p in saved.get("probes", [])]})
    except (OSError, ValueError, TypeError):
        return None
    return record if record.basis == basis else None
