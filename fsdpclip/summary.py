"""What `fsdpclip validate` reports about a job that builds: parameters per tower, FSDP units, decay
groups, batch, and the per-GPU memory estimate (checked against `launch.gpu_memory_gib`)."""

from __future__ import annotations

from typing import Optional

from fsdpclip.estimate import GIB, MemoryEstimate, activation_elements, estimate_memory, traced_forward
from fsdpclip.model import SHARED_PARAMETERS, Tower, count, image_shape, text_shape
from fsdpclip.problems import Report
from fsdpclip.shard import Unit, checkpointed_modules, plan_units
from fsdpclip.spec import TOWERS, Job
from fsdpclip.trainable import DecayGroup


def summarise(job: Job, model, towers: dict[str, Tower], frozen: set[str], groups: list[DecayGroup],
               steps: Optional[int], report: Report) -> None:
    params = dict(model.named_parameters())
    summary: dict = {"model": job.model.label, "class": type(model).__name__, "world_size": report.world_size}
    tower_rows = {}
    for name in TOWERS + ("shared",):
        names = towers[name].parameters if name in towers else [n for n in SHARED_PARAMETERS if n in params]
        total = count(params[n] for n in names)
        trainable = count(params[n] for n in names if n not in frozen)
        tower_rows[name] = {"parameters": total, "trainable": trainable, "frozen": total - trainable,
                            "blocks": len(towers[name].blocks) if name in towers else 0,
                            "block_classes": list(towers[name].block_classes) if name in towers else []}
    summary["towers"] = tower_rows
    summary["parameters"] = {k: sum(r[k] for r in tower_rows.values()) for k in ("parameters", "trainable", "frozen")}
    units = plan_units(model, towers, job.fsdp)
    summary["fsdp_units"] = _unit_rows(units, report.world_size)
    summary["decay_groups"] = [{"rule": "default" if g.rule is None else f"decay_rules[{g.rule}]",
                                "weight_decay": g.weight_decay, "tensors": len(g.names),
                                "parameters": count(params[n] for n in g.names)} for g in groups]
    world, batch = report.world_size, job.batch
    summary["batch"] = {"per_gpu": batch.per_gpu, "grad_accum": batch.grad_accum,
                        "global": job.samples_per_step(world), "steps": steps}
    checkpointed = set(checkpointed_modules(model, towers, job.fsdp))
    try:
        sizes, widths = traced_forward(model, [b for tower in towers.values() for b in tower.blocks])
    except Exception as exc:  # any failure of the model's own forward is the user's to see, not a traceback
        report.error("model", f"a forward pass on the meta device fails: {type(exc).__name__}: {str(exc)[:300]}")
        return
    if widths[0] != widths[1]:
        report.error("model", f"the image tower gives {widths[0]}-d features, the text tower {widths[1]}-d",
                     hint="both must project to embed_dim (model.image.timm.proj 'none' keeps the trunk's width)")
        return
    channels, height, width = image_shape(model)
    input_bytes = channels * height * width * 4 + text_shape(model)[0] * 8  # fp32 pixels, int64 tokens
    estimate = estimate_memory(job, units, activation_elements(model, towers, checkpointed, sizes), world,
                               input_bytes, widths[0])
    summary["memory_gib"] = estimate.as_gib()
    report.summary = summary
    _check_memory(job, estimate, report)


def _unit_rows(units: list[Unit], world_size: int) -> list[dict]:
    """Units grouped by tower and class: count, parameters each, bytes per GPU (fp32 shards)."""
    rows: dict[tuple, dict] = {}
    for unit in units:
        key = (unit.tower or "root", unit.cls, unit.numel)
        row = rows.setdefault(key, {"tower": unit.tower or "root", "class": unit.cls, "count": 0,
                                    "modules_each": len(unit.modules), "parameters_each": unit.numel,
                                    "shard_mib_each": 0.0, "first": unit.modules[0] or "(root)"})
        row["count"] += 1
        row["shard_mib_each"] = round(unit.shard_numel(world_size) * 4 / 2 ** 20, 3)
    return list(rows.values())


def _check_memory(job: Job, estimate: MemoryEstimate, report: Report) -> None:
    limit = job.launch.gpu_memory_gib
    if limit is not None and estimate.total > limit * GIB:
        report.warn("launch.gpu_memory_gib", f"estimated peak {estimate.total / GIB:.1f} GiB per GPU exceeds "
                    f"{limit:g} GiB", limit, hint="more GPUs, activation checkpointing, CPU offload or a smaller batch")
