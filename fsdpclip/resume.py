"""What a relaunch may change: a new spec against the spec its checkpoint was saved by.

A checkpoint fixes what its weights are (the model and its towers, the frozen ranges, the loss
kind, the weight-decay groups of its optimizer state); a relaunch that changes those is refused
before any rank starts. Everything else (learning rate, schedule, steps,
batch, data workers, world size, precision, sharding, logging) is applied as written from the
step the checkpoint holds, and each change is reported. No torch: `validate` and `launch` use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdpclip.spec import Job

# Fields (dotted, prefixes end with '.') that a checkpoint fixes.
FIXED = ("model.", "freeze.", "loss.kind", "optimizer.decay_rules")
# Fields that describe where to resume from, not what to train.
IGNORED = ("checkpoint.resume", "$schema")
# Fields whose change means the saved data position no longer applies (the stream restarts its epoch),
# less those that change how the same samples are made, not which (the crops are drawn alike either way).
DATA_STREAM = ("data.", "batch.per_gpu", "run.seed")
SAME_STREAM = ("data.decode",)


@dataclass(frozen=True)
class Change:
    """One field that differs between a checkpoint's spec and the new one."""

    field: str
    before: Any
    after: Any

    def __str__(self) -> str:
        return f"{self.field}: {_short(self.before)} → {_short(self.after)}"


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A spec as {dotted field: value}; lists of blocks stay whole values."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: value}


def spec_changes(saved: dict, job: Job) -> list[Change]:
    """Every field of the new spec that differs from the saved one (its resolved JSON)."""
    import json

    before, after = flatten(saved), flatten(json.loads(job.to_json()))
    return [Change(field, before.get(field), after.get(field)) for field in sorted(set(before) | set(after))
            if before.get(field) != after.get(field) and not field.startswith(IGNORED)]


def is_fixed(change: Change) -> bool:
    return change.field.startswith(FIXED)


def keeps_data_position(changes: list[Change]) -> bool:
    """Whether the saved data position still describes the new data stream."""
    return not any(c.field.startswith(DATA_STREAM) and not c.field.startswith(SAME_STREAM) for c in changes)


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"
