"""What a relaunch may change: a new spec against the spec its checkpoint was saved by.

A checkpoint fixes what its weights are (the model and its towers, the frozen ranges, the loss
kind, the weight-decay groups of its optimizer state); a relaunch that changes those is refused
before any rank starts. Everything else (learning rate, schedule, steps,
batch, data workers, world size, precision, sharding, logging) is applied as written from the
step the checkpoint holds, and each change is reported. Files are compared by what they hold, not
where they are: a model-config file by its content, local shards by their sizes and modification
times. No torch: `validate` and `launch` use it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fsdpclip.spec.preprocess import PREPROCESSING_KEYS
from fsdpclip.spec.job import Job
from fsdpclip.spec.registry import DATA_SOURCES

# Fields (dotted, prefixes end with '.') that a checkpoint fixes.
FIXED = ("model.", "freeze.", "loss.kind", "optimizer.decay_rules", "optimizer.layer_decay.")
# Fields that describe where to resume from, not what to train.
IGNORED = ("checkpoint.resume", "$schema")
# Fields whose change means the saved data position no longer applies (the stream restarts its epoch),
# less those that change how the same samples are made, not which.
DATA_STREAM = ("data.", "batch.per_gpu", "run.seed")
SAME_STREAM = ("data.decode", "data.preprocess")
# Fields `batch.per_gpu: "auto"` settles at start: the trainer compares what it settled (a relaunch reuses its record).
SEARCHED = ("batch.per_gpu", "batch.grad_accum")


@dataclass(frozen=True)
class Change:
    """One field that differs between a checkpoint's spec and the new one."""

    field: str
    before: Any
    after: Any
    note: Optional[str] = None  # what changed, where before → after would not say it

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


def checkpoint_changes(meta: dict, job: Job, config: Optional[dict],
                       shards: Callable[[], Optional[dict]]) -> list[Change]:
    """Every change of the new spec against a checkpoint's (`spec_changes` of its meta.json), files by content.

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
    return changes


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
    """Whether the saved data position still describes the new data stream."""
    return not any(c.field.startswith(DATA_STREAM) and not c.field.startswith(SAME_STREAM) for c in changes)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
