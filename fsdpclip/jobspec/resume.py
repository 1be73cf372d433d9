"""What a relaunch may change: a new spec against the spec its checkpoint was saved by.

A checkpoint fixes what its weights are (the model and its towers, the frozen ranges, the loss
kind, the weight-decay groups of its optimizer state); a relaunch that changes those is refused
before any rank starts. Everything else (learning rate, schedule, steps,
batch, data workers, world size, precision, sharding, logging) is applied as written from the
step the checkpoint holds, and each change is reported. Files are compared by what they hold, not
where they are: a model-config file by its content, local shards by their sizes and modification
times.

A relaunch on another world size keeps the checkpoint's global batch where the ranks divide it
(`kept_batch`: grad_accum, else per_gpu too, adjusted), and its data streams where the counts allow
(`kept_streams`: each rank then reads the data streams of one or more of the ranks that saved it). What a relaunch
changes in the run itself (its global batch, its length in steps, the LR of the step it resumes at) is a
`Change` that is a consequence: resumed only with `checkpoint.accept_changes`. No torch: `validate` and
`launch` use it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from fsdpclip.jobspec.preprocess import PREPROCESSING_KEYS
from fsdpclip.jobspec.job import Job, largest_divisor
from fsdpclip.jobspec.source import DATA_SOURCES

# Fields (dotted, prefixes end with '.') that a checkpoint fixes.
FIXED = ("model.", "freeze.", "loss.kind", "optimizer.decay_rules", "optimizer.layer_decay.")
# Fields that describe where to resume from, not what to train.
IGNORED = ("checkpoint.resume", "checkpoint.accept_changes", "$schema")
# Fields whose change means the saved data position no longer applies (the stream restarts its epoch),
# less those that change how the same samples are made, not which.
DATA_STREAM = ("data.", "batch.per_gpu", "run.seed")
SAME_STREAM = ("data.decode", "data.jpeg_engines", "data.preprocess")
# Fields `batch.per_gpu: "auto"` settles at start: the trainer compares what it settled (a relaunch reuses its record).
SEARCHED = ("batch.per_gpu", "batch.grad_accum")
# Fields whose change is a change of the run's length, or of its LR curve: what the run's length or LR then does
# is what was asked for (still reported), not a consequence to accept.
LENGTH = ("schedule.steps", "schedule.epochs", "data.samples")
LR_CURVE = ("optimizer.lr", "schedule.kind", "schedule.warmup_steps", "schedule.min_lr", "schedule.decay_")


@dataclass(frozen=True)
class Change:
    """One field that differs between a checkpoint's spec and the new one."""

    field: str
    before: Any
    after: Any
    note: Optional[str] = None  # what changed, where before → after would not say it
    consequence: bool = False  # the run itself changes (global batch, length, LR): resumed only when accepted

    def __str__(self) -> str:
        return f"{self.field}: {self.note or f'{_short(self.before)} → {_short(self.after)}'}"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A spec as {dotted field: value}; lists of blocks stay whole values."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def spec_changes(saved: dict, job: Job) -> list[Change]:
    """Every field of the new spec that differs from the saved one (its resolved JSON); with per_gpu 'auto', not
    the batch it settles at start."""
    before, after = flatten(saved), flatten(json.loads(job.to_json()))
    unsettled = SEARCHED if job.batch.searched else ()
    return [Change(field, before.get(field), after.get(field)) for field in sorted(set(before) | set(after))
            if before.get(field) != after.get(field) and not field.startswith(IGNORED) and field not in unsettled]


def checkpoint_changes(meta: dict, job: Job, config: Optional[dict], shards: Callable[[], Optional[dict]],
                       world: Optional[int] = None) -> list[Change]:
    """Every change of the new spec against a checkpoint's (`spec_changes` of its meta.json), files by content,
    and what they change in the run on `world` ranks (default: the spec's): `consequences`.

    `config`: the OpenCLIP config this spec makes (None where it cannot be made). A spec with a model-config
    file has it compared with the config the checkpoint was trained with, not by path: the file edited in
    place is another model, an identical copy elsewhere the same. `shards` gives `shard_fingerprint` of this
    spec's data, asked only where the checkpoint holds one and the URLs are the same: the same URLs naming
    other files than the checkpoint read is a change of `data.urls` (the saved data position would point at
    other samples).
    """
    if "job" not in meta:
        return []
    changes = spec_changes(meta["job"], job)
    saved_config = meta.get("model", {}).get("open_clip_config")
    by_file = job.model.config is not None or meta["job"].get("model", {}).get("config") is not None
    if by_file and saved_config is not None and config is not None:
        changes = [c for c in changes if c.field != "model.config"]
        if not any(c.field.startswith("model.") for c in changes):  # those change the config too: said already
            changes += _config_changes(saved_config, config)
    saved_shards = meta.get("shards")
    if saved_shards and not any(c.field.startswith("data.") for c in changes):
        found = shards()
        if found and found != saved_shards:
            urls = job.data.urls  # None for a mixture (data.sources)
            changes.append(Change("data.urls" if urls is not None else "data.sources", urls, urls, note=(
                f"the same URLs name other files than the checkpoint read ({found['local']} local shards: names, "
                "sizes or modification times differ)")))
    return changes + consequences(meta, job, world or job.launch.world_size, changes)


def kept_batch(job: Job, meta: dict, world: int) -> Job:
    """`job` with the global batch of the checkpoint whose meta.json is `meta`, where it is resumed on another
    number of ranks (`world`): grad_accum set so that per_gpu × grad_accum × ranks is the checkpoint's, with the
    largest per_gpu up to the spec's that divides the share of each rank (per_gpu 'auto': global_batch set, the
    search splits it); on the checkpoint's own world size too (a spec relaunched as written after a resume on
    another one goes on with the batch that resume kept). The job as it is where `batch.global_batch` asks for
    another, where the ranks do not divide the checkpoint's global batch (a consequence then), or where per_gpu
    'auto' resumes on the checkpoint's world size (its search's record applies)."""
    saved, saved_world = meta.get("job"), meta.get("world_size")
    if saved is None or saved_world is None or "imported" in meta or saved_world == world and job.batch.searched:
        return job
    target = saved["batch"]["per_gpu"] * saved["batch"]["grad_accum"] * saved_world
    batch = job.batch
    if batch.global_batch not in (None, target) or target % world:
        return job
    share = target // world
    if batch.searched:
        return job.model_copy(update={"batch": batch.model_copy(update={"global_batch": target, "grad_accum": 1})})
    per_gpu = largest_divisor(share, batch.settled_per_gpu)
    return job.model_copy(update={"batch": batch.model_copy(update={
        "per_gpu": per_gpu, "grad_accum": share // per_gpu, "global_batch": batch.global_batch and target})})


def kept_streams(meta: dict, job: Job, changes: list[Change], world: int) -> Optional[int]:
    """The checkpoint's data ranks (one data stream each) where their saved positions still apply to a run
    resumed on `world` ranks: the data and per_gpu the same, the ranks dividing the streams and each rank's micro
    batches a step dividing among those it reads (`streams ÷ world` of them, in turn). None where they do not: the
    run then has a stream per rank, started again at its epoch."""
    saved = meta.get("data_ranks", meta.get("world_size"))
    if saved is None or "imported" in meta or not keeps_data_position(changes) or saved % world or \
            job.batch.grad_accum % (saved // world):
        return None
    return saved


def consequences(meta: dict, job: Job, world: int, changes: list[Change]) -> list[Change]:
    """What resuming the checkpoint of `meta` with `job` on `world` ranks changes in the run against the
    checkpoint's own spec going on where it was saved: the global batch, the length in steps (unless the length
    was asked for: `LENGTH`) and the LR of the step it resumes at (unless the LR curve was: `LR_CURVE`); and, as
    plain changes, a global batch kept on another world size and data streams read on fewer ranks. None where
    the saved spec no longer reads, the checkpoint names no step or the batch is settled only at start (per_gpu
    'auto')."""
    try:
        saved = Job.model_validate(meta["job"])
    except (KeyError, ValueError):
        return []
    if job.batch.searched or saved.batch.searched or "step" not in meta:
        return []
    step, seen = meta["step"], meta.get("samples_seen", 0)
    saved_world = saved.launch.world_size if "imported" in meta else meta["world_size"]  # an import's whole save: 1
    found = []
    before, after = saved.samples_per_step(saved_world), job.samples_per_step(world)
    layout = f"per_gpu × grad_accum × ranks: {job.batch.per_gpu} × {job.batch.grad_accum} × {world}"
    if before != after:
        found.append(Change("batch", before, after, consequence=True, note=(
            f"the global batch {before} → {after} samples a step ({layout}; the checkpoint's "
            f"{saved.batch.per_gpu} × {saved.batch.grad_accum} × {saved_world})")))
    elif world != saved_world:
        found.append(Change("batch", before, after, note=f"the global batch of {after} kept on {world} rank(s) "
                                                         f"({layout})"))
    streams = kept_streams(meta, job, changes, world)
    if world != saved_world and streams:
        found.append(Change("data", saved_world, world, note=(
            f"the {streams} data streams go on where they stopped, {streams // world} read by each rank in turn")))
    total_before = saved.total_steps(saved_world, step, seen, meta.get("data_ranks"))
    total_after = job.total_steps(world, step, seen, streams)
    if total_before is None or total_after is None:
        return found
    asked = {prefix for c in changes for prefix in (*LENGTH, *LR_CURVE) if c.field.startswith(prefix)}
    if total_before != total_after:
        found.append(Change("schedule", total_before, total_after, consequence=not asked & set(LENGTH),
                            note=f"the run's length {total_before} → {total_after} steps"))
    lr_before, lr_after = saved.lr(step, total_before), job.lr(step, total_after)
    if not math.isclose(lr_before, lr_after, rel_tol=1e-6, abs_tol=1e-12):
        found.append(Change("schedule", lr_before, lr_after, consequence=not asked & set(LR_CURVE), note=(
            f"the LR of step {step + 1}, where it resumes: {lr_before:.3g} → {lr_after:.3g}"
            + (" (its schedule recomputed over the new length)" if total_before != total_after else ""))))
    if total_after <= step:  # nothing left to train: nothing of the run changes
        return [replace(change, consequence=False) for change in found]
    return found


def unaccepted(changes: list[Change], job: Job) -> list[Change]:
    """The consequences among `changes` that `job` does not accept (`checkpoint.accept_changes`)."""
    return [] if job.checkpoint.accept_changes else [c for c in changes if c.consequence]


def _config_changes(saved: dict, config: dict) -> list[Change]:
    """The keys (dotted) in which a model config differs from the saved one, as one change of model.config."""
    before, after = flatten(saved), flatten(json.loads(json.dumps(config)))
    keys = sorted(k for k in set(before) | set(after)
                  if before.get(k) != after.get(k) and k.split(".")[0] not in PREPROCESSING_KEYS)
    return [Change("model.config", {k: before.get(k) for k in keys}, {k: after.get(k) for k in keys})] if keys else []


def shard_fingerprint(job: Job) -> Optional[dict]:
    """What tells the data's local files apart cheaply (`DataSource.fingerprint`: a webdataset spec's shard
    count and a digest of their paths, sizes and modification times); None for data without files."""
    return DATA_SOURCES[job.data.source].fingerprint(job.data)


def is_fixed(change: Change) -> bool:
    return change.field.startswith(FIXED)


def keeps_data_position(changes: list[Change]) -> bool:
    """Whether the saved data position still describes the new data stream (data.workers changed to 'auto' does:
    the stream goes on with the checkpoint's count)."""
    return not any(c.field.startswith(DATA_STREAM) and not c.field.startswith(SAME_STREAM)
                   and not (c.field == "data.workers" and c.after == "auto") for c in changes)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
