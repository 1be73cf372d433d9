"""What `fsdpclip validate` reports about a job that builds: parameters per tower, FSDP units, decay
groups, batch, the device mesh with its traffic per step, the per-GPU memory estimate (checked against
`launch.gpu_memory_gib`), the host memory of a node (checked against `launch.host_memory_gib`, else this
machine's) and, on GPUs, the run's expected duration at `fsdpclip plan`'s step time."""

from __future__ import annotations

from typing import Optional

from fsdpclip.model.build import SHARED_PARAMETERS, Tower, count, training_flops_per_sample
from fsdpclip.model.trainable import DecayGroup
from fsdpclip.model.units import Unit
from fsdpclip.run.node import host_memory, usable_cores
from fsdpclip.plan.memory import GIB, HostEstimate, MemoryEstimate, estimate_host_memory, host_parts
from fsdpclip.plan.mesh import MemoryModel, ShardDegreeError, memory_model, strategy, sustained_tflops, \
    valid_shard_degrees
from fsdpclip.plan.resolved import Node, RunPlan, plan_for_node, unit_layout
from fsdpclip.jobspec.problems import Report
from fsdpclip.jobspec.job import TOWERS, Job
from fsdpclip.jobspec.source import DATA_SOURCES


def summarise(job: Job, model, towers: dict[str, Tower], frozen: set[str], groups: list[DecayGroup],
               steps: Optional[int], report: Report, this_machine: Optional[str] = None) -> None:
    """The summary into `report.summary`, and the memory problems; `this_machine` ('error', 'warning' or None):
    how a host estimate over this machine's memory is reported where the spec gives no launch.host_memory_gib
    (an error where this machine is the first node, a launch here)."""
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
    summary["decay_groups"] = [{"rule": "default" if g.rule is None else f"decay_rules[{g.rule}]",
                                "weight_decay": g.weight_decay, "lr_scale": g.lr_scale, "tensors": len(g.names),
                                "parameters": count(params[n] for n in g.names)} for g in groups]
    world, batch = report.world_size, job.batch
    summary["preprocess"] = preprocess_summary(model)
    summary["data"] = DATA_SOURCES[job.data.source].describe(job.data)
    rate = sustained_tflops(summary["parameters"]["parameters"])
    flops = training_flops_per_sample(model) if job.launch.device == "cuda" else None  # plan's step time: GPUs
    try:
        memory, widths = memory_model(job, model, towers, unit_layout(job.fsdp, model, towers, job.launch.device))
    except Exception as exc:  # any failure of the model's own forward is the user's to see, not a traceback
        report.error("model", f"a forward pass on the meta device fails: {type(exc).__name__}: {str(exc)[:300]}")
        return
    if widths[0] != widths[1]:
        report.error("model", f"the image tower gives {widths[0]}-d features, the text tower {widths[1]}-d",
                     hint="both must project to embed_dim (model.image.timm.proj 'none' keeps the trunk's width)")
        return
    plan = _plan(job, model, towers, memory, flops, report)
    degree = plan.shard_degree if plan else world  # a degree that does not fit the world: check_job says so
    data = plan.data if plan else {}
    summary["plan"] = plan.as_dict() if plan else None
    summary["batch"] = {"per_gpu": batch.per_gpu, "grad_accum": batch.grad_accum,
                        "global": job.samples_per_step(world), "steps": steps,
                        "decode": data.get("decode") and data["decode"] + ("+engines" if data["jpeg_engines"] else "")}
    summary["supply"] = _supply(job, data, report, rate * 1e12 / flops if flops else None)
    summary["fsdp_units"] = _unit_rows(memory.units, degree)
    estimate = memory.estimate(world, degree)
    summary["mesh"] = {"shard_degree": degree, "replicas": world // degree, "auto": job.fsdp.shard_degree == "auto",
                       "decided_at_start": bool(plan) and "shard_degree" in plan.pending,
                       "traffic_gib_per_step": memory.traffic(world, degree).as_gib()}
    summary["memory_gib"] = estimate.as_gib()
    summary["duration"] = _duration(job, memory, flops, degree, steps, rate, report) if flops and steps else None
    host = estimate_host_memory(estimate, summary["parameters"]["parameters"], report.gpus_per_node)
    summary["host_memory_gib"] = host.as_gib()
    report.summary = summary
    _check_memory(job, estimate, report)
    _check_host_memory(job, host, report, this_machine)


def _duration(job: Job, memory: MemoryModel, flops: float, degree: int, steps: int, rate: float,
              report: Report) -> dict:
    """The run's expected duration on GPUs: its steps at the step time `plan` gives the job's shard degree (its
    model of an H200: `rate` TFLOP/s sustained, NVLink and InfiniBand NDR)."""
    per_node = report.gpus_per_node
    step = strategy(job, memory, flops, report.world_size // per_node, per_node, degree, rate).step_s
    return {"steps": steps, "step_s": step, "seconds": steps * step, "tflops": rate}


def preprocess_summary(model) -> dict:
    """The model's resolved preprocessing (data.preprocess over its own), named as data.preprocess names it."""
    preprocess, augmentation = model.visual.preprocess_cfg, model.visual.augmentation_cfg
    jitter = augmentation.get("color_jitter")
    return {"size": list(preprocess["size"]) if isinstance(preprocess["size"], (list, tuple)) else preprocess["size"],
            **{key: list(preprocess[key]) if isinstance(preprocess[key], tuple) else preprocess[key]
               for key in ("mean", "std", "interpolation", "resize_mode")},
            "crop_scale": list(augmentation["scale"]),
            "color_jitter": None if not augmentation.get("color_jitter_prob") else
            {"prob": augmentation["color_jitter_prob"],
             **dict(zip(("brightness", "contrast", "saturation", "hue"), jitter))},
            "grayscale_prob": augmentation.get("gray_scale_prob") or 0.0}


def _plan(job: Job, model, towers: dict[str, Tower], memory: MemoryModel, flops: Optional[float],
          report: Report) -> Optional[RunPlan]:
    """The run plan for the report's world (a GPU's memory from launch.gpu_memory_gib; this machine's cores), or
    None where the spec's shard degree does not fit the world; reports a given degree whose estimate does not fit
    the memory where a larger one does."""
    world, per_node, limit = report.world_size, report.gpus_per_node, job.launch.gpu_memory_gib
    node = Node(world, per_node, job.launch.device, usable_cores(), limit * GIB if limit else None)
    try:
        plan = plan_for_node(job, model, towers, node, flops, memory=memory)
    except ShardDegreeError:  # said by check_job, whether the model builds or not
        return None
    chosen = job.fsdp.shard_degree
    if chosen != "auto" and limit is not None and memory.estimate(world, chosen).total > limit * GIB:
        fitting = [d for d in valid_shard_degrees(world, per_node)
                   if d > chosen and memory.estimate(world, d).total <= limit * GIB]
        if fitting:
            report.error("fsdp.shard_degree", f"estimated peak {memory.estimate(world, chosen).total / GIB:.1f} GiB "
                         f"per GPU with groups of {chosen} exceeds launch.gpu_memory_gib {limit:g}", chosen,
                         hint=f"shard_degree {fitting[0]} fits "
                              f"({memory.estimate(world, fitting[0]).total / GIB:.1f} GiB)")
    return plan


def _unit_rows(units: list[Unit], shard_degree: int) -> list[dict]:
    """Units grouped by tower and class: count, parameters each, bytes per GPU (fp32 shards)."""
    rows: dict[tuple, dict] = {}
    for unit in units:
        key = (unit.tower or "root", unit.cls, unit.numel)
        row = rows.setdefault(key, {"tower": unit.tower or "root", "class": unit.cls, "count": 0,
                                    "modules_each": len(unit.modules), "parameters_each": unit.numel,
                                    "shard_mib_each": 0.0, "first": unit.modules[0] or "(root)"})
        row["count"] += 1
        row["shard_mib_each"] = round(unit.shard_numel(shard_degree) * 4 / 2 ** 20, 3)
    return list(rows.values())


def _check_memory(job: Job, estimate: MemoryEstimate, report: Report) -> None:
    limit = job.launch.gpu_memory_gib
    if limit is not None and estimate.total > limit * GIB:
        report.warn("launch.gpu_memory_gib", f"estimated peak {estimate.total / GIB:.1f} GiB per GPU exceeds "
                    f"{limit:g} GiB", limit, hint="more GPUs, activation checkpointing, CPU offload or a smaller batch")


def _check_host_memory(job: Job, host: HostEstimate, report: Report, this_machine: Optional[str]) -> None:
    """A node whose host memory the estimate exceeds: launch.host_memory_gib's (an error), else this machine's
    (reported as `this_machine` says)."""
    limit, where, severity = job.launch.host_memory_gib, "launch.host_memory_gib", "error"
    if limit is None and this_machine:
        limit, where, severity = host_memory() / GIB, "this machine's memory", this_machine
    if limit is None or host.total <= limit * GIB:
        return
    gib = host.as_gib()
    location = "launch.host_memory_gib" if job.launch.host_memory_gib else \
        "fsdp.cpu_offload" if job.fsdp.cpu_offload else "launch.gpus_per_node"
    hint = "more nodes (fewer ranks per node)" + (", or without fsdp.cpu_offload if the GPUs hold the state"
                                                  if job.fsdp.cpu_offload else "")
    if severity == "warning":
        hint += "; where the nodes are other machines, set launch.host_memory_gib to their memory"
    (report.error if severity == "error" else report.warn)(
        location, f"estimated host memory of the first node {host_parts(gib)} exceeds {where} {limit:.1f} GiB",
        job.launch.host_memory_gib, hint=hint)



def _supply(job: Job, data: dict, report: Report, asked: Optional[float]) -> Optional[dict]:
    """The data workers a rank starts (the plan's `data.workers`, settled for this machine's cores) and, on CUDA,
    the samples/s each GPU `asked` of them at the step time `plan` models (its sustained rate for a model of this
    size); None for data without workers."""
    if "workers" not in data:
        return None
    return {"workers": data["workers"], "auto": job.data.workers == "auto", "cores": usable_cores(),
            "ranks_per_node": report.gpus_per_node, "asked_per_gpu": asked}
