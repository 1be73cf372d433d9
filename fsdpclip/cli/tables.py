"""Rich renderings of what `validate`, `plan` and `report` found: tables and lines, no printing of their
own."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from fsdpclip.data.transform import DECODED_WHERE
from fsdpclip.plan.memory import GIB, host_parts

if TYPE_CHECKING:
    from fsdpclip.plan.mesh import Plan
    from fsdpclip.jobspec.job import Job


def summary_tables(summary: dict) -> list:
    """validate's summary: parameters per tower, FSDP units, decay groups, memory, then the mesh and
    batch lines (and the data's, where its source has one)."""
    params = Table(title=escape(f"{summary['model']} ({summary['class']})"))
    for column in ("tower", "parameters", "trainable", "frozen", "blocks", "block class"):
        params.add_column(column, justify="right" if column not in ("tower", "block class") else "left")
    for tower, row in summary["towers"].items():
        params.add_row(tower, f"{row['parameters']:,}", f"{row['trainable']:,}", f"{row['frozen']:,}",
                       str(row["blocks"] or ""), escape(", ".join(row["block_classes"])))
    total = summary["parameters"]
    params.add_row("total", f"{total['parameters']:,}", f"{total['trainable']:,}", f"{total['frozen']:,}", "", "",
                   style="bold")

    mesh = summary["mesh"]
    units = Table(title=f"FSDP units (sharded over {mesh['shard_degree']} of {summary['world_size']} ranks)")
    for column in ("tower", "class", "units", "blocks each", "parameters each", "fp32 shard each", "first"):
        units.add_column(column, justify="left" if column in ("tower", "class", "first") else "right")
    for row in summary["fsdp_units"]:
        units.add_row(row["tower"], escape(row["class"]), str(row["count"]), str(row["modules_each"]),
                      f"{row['parameters_each']:,}", f"{row['shard_mib_each']:,.2f} MiB", escape(row["first"]))

    decay = Table(title="Weight decay groups (original parameter names)")
    for column in ("rule", "weight decay", "lr scale", "tensors", "parameters"):
        decay.add_column(column, justify="left" if column == "rule" else "right")
    for row in summary["decay_groups"]:
        decay.add_row(escape(row["rule"]), f"{row['weight_decay']:g}", f"{row['lr_scale']:.4g}", str(row["tensors"]),
                      f"{row['parameters']:,}")

    memory = summary["memory_gib"]
    mem = Table(title="Estimated memory per GPU (GiB)")
    columns = ("parameters", "gradients", "optimizer", *(("ema",) if memory["ema"] else ()), "unsharded",
               "activations", "inputs", "total", "host")
    for key in columns:
        mem.add_column(key, justify="right")
    mem.add_row(*(f"{memory[k]:.2f}" for k in columns))
    mem.caption = f"host memory of the first node: {host_parts(summary['host_memory_gib'])}"

    batch = summary["batch"]
    steps = f"{batch['steps']:,}" if batch["steps"] is not None else "?"
    batch_line = (f"batch: {batch['per_gpu']} per GPU × {batch['grad_accum']} accumulation × "
                  f"{summary['world_size']} ranks = {batch['global']:,} per step; {steps} steps")
    if "auto" in batch:
        batch_line += "; " + auto_batch_note(batch["auto"])
    if batch["decode"]:
        batch_line += f"; images decoded {DECODED_WHERE[batch['decode']]}"
    duration = [duration_line(summary["duration"])] if summary.get("duration") else []
    data = [f"data: {escape(summary['data'])}"] if summary.get("data") else []
    if summary.get("supply"):
        data.append(supply_line(summary["supply"]))
    plan = [plan_line(summary["plan"])] if summary.get("plan") else []
    return [params, units, decay, mem, mesh_line(summary["world_size"], mesh), batch_line, *duration,
            preprocess_line(summary["preprocess"]), *data, *plan]


def plan_line(plan: dict) -> str:
    """The run plan (every 'auto' settled; plan.resolved.RunPlan) in one line, with what the ranks settle at
    start."""
    layout = plan["layout"]
    units = ", ".join(f"{tower} {'/'.join(classes) if classes else 'blocks'} × {layout['unit_size'][tower]}"
                      for tower, classes in layout["wrap"].items())
    data = "".join(f", data.{key} {value}" for key, value in plan["data"].items())
    pending = f" (settled again at start: {', '.join(plan['pending'])})" if plan["pending"] else ""
    return (f"plan: shard degree {plan['shard_degree']}, {plan['per_gpu']} per GPU × {plan['grad_accum']}, "
            f"init {plan['init']}, units {units}, reshard_after_forward {layout['reshard_after_forward']}, "
            f"compile {layout['compile']}, float8 {layout.get('float8', False)}, cuda_graph {plan['cuda_graph']}, "
            f"grad_scaler {plan['grad_scaler']}, "
            f"async_save {plan['async_save']}{data}{pending}")


def duration_line(duration: dict) -> str:
    """The run's expected duration on GPUs, with what it rests on."""
    seconds = duration["seconds"]
    span = f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h" if seconds < 172800 else f"{seconds / 86400:.1f} days"
    return (f"duration: ≈ {span}, {duration['steps']:,} steps at the plan's {duration['step_s']:.3g} s/step (its H200 "
            f"model: {duration['tflops']:g} TFLOP/s sustained; `fsdpclip plan --tflops` prices other GPUs)")


def supply_line(supply: dict) -> str:
    """The data workers a rank starts and, on CUDA, the rate each GPU will ask of them."""
    auto = (f" (data.workers 'auto': {supply['cores']} cores here for {supply['ranks_per_node']} ranks a node, "
            "settled again on the node that trains)" if supply["auto"] else "")
    line = f"data workers: {supply['workers']} per rank{auto}"
    if supply["asked_per_gpu"]:
        line += (f"; each GPU will ask ~{supply['asked_per_gpu']:,.0f} samples/s of them (the step time `fsdpclip "
                 "plan` models)")
    return line


def preprocess_line(preprocess: dict) -> str:
    """The resolved data.preprocess in one line: normalisation, evaluation's resize, training's augmentation."""
    numbers = lambda values: "(" + ", ".join(f"{v:.4g}" for v in values) + ")"  # noqa: E731
    size = preprocess["size"] if isinstance(preprocess["size"], list) else [preprocess["size"]] * 2
    jitter = preprocess["color_jitter"]
    low, high = preprocess["crop_scale"]
    return (f"images: {size[0]}×{size[1]}, mean {numbers(preprocess['mean'])}, std {numbers(preprocess['std'])}; "
            f"evaluation resizes {preprocess['interpolation']} ('{preprocess['resize_mode']}'); training crops "
            f"{low:g}–{high:g} of the area" +
            (f", colour jitter p {jitter['prob']:g} (brightness {jitter['brightness']:g}, contrast "
             f"{jitter['contrast']:g}, saturation {jitter['saturation']:g}, hue {jitter['hue']:g})" if jitter else "") +
            (f", grayscale p {preprocess['grayscale_prob']:g}" if preprocess["grayscale_prob"] else ""))


def auto_batch_note(auto: dict) -> str:
    """What `batch.per_gpu: "auto"` starts from, as `validate` shows it."""
    if auto["start"] is None:
        return ("per_gpu 'auto': searched at start from the estimate for its GPU (set launch.gpu_memory_gib to see "
                "it here; shown at 1 per GPU)")
    return (f"per_gpu 'auto': searched at start from the estimate {auto['start']} per GPU for "
            f"{auto['capacity_gib']:g} GiB, keeping 90% of the largest that fits (shown at the estimate)")


def mesh_line(world: int, mesh: dict) -> str:
    """The mesh in one line, with the bytes one GPU moves per step inside its group and across replicas."""
    degree, replicas, moved = mesh["shard_degree"], mesh["replicas"], mesh["traffic_gib_per_step"]
    kind = "full sharding" if replicas == 1 else "replication" if degree == 1 else "HSDP"
    how = " ('auto': decided at start from the GPUs' memory; full sharding shown)" if mesh["decided_at_start"] \
        else " ('auto')" if mesh["auto"] else ""
    return (f"mesh: {replicas} replica(s) × shard groups of {degree} = {world} ranks, {kind}{how}; per GPU and "
            f"step: {moved['all_gather']:.3f} GiB all-gathered and {moved['reduce_scatter']:.3f} GiB "
            f"reduce-scattered inside the shard group, {moved['all_reduce']:.3f} GiB all-reduced across replicas")


def plan_table(job: "Job", plan: "Plan", capacity_gib: float) -> Table:
    """One row per strategy, marking the degree 'auto' takes, the spec's, the fastest that fits and
    what does not fit."""
    model = job.model.name or job.model.config or job.model.label  # a composed model has neither name nor config
    table = Table(title=f"{escape(model)}: {plan.nodes} node(s) × {plan.gpus_per_node} GPUs, "
                        f"{job.batch.per_gpu * job.batch.grad_accum} samples per GPU and step")
    offload = job.fsdp.cpu_offload  # the host's share then changes with the degree
    for column in ("strategy", "shard group", "replicas", "memory GiB/GPU", *(("host GiB/node",) if offload else ()),
                   "in group GiB", "across replicas GiB", "compute ms", "comm ms", "step ms", "samples/s/GPU", ""):
        table.add_column(column, justify="left" if column in ("strategy", "") else "right")
    fitting = [r.samples_per_s_per_gpu for r in plan.rows if r.memory_gib <= capacity_gib]
    best = max(fitting) if fitting else None
    for row in plan.rows:
        marks = [m for m, on in (("auto", row.degree == plan.auto_degree),
                                 ("spec", row.degree == job.fsdp.shard_degree),
                                 ("fastest", row.samples_per_s_per_gpu == best),
                                 ("does not fit", row.memory_gib > capacity_gib)) if on]
        memory = f"{row.memory_gib:.1f}"
        table.add_row(row.name, str(row.degree), str(row.replicas),
                      f"[red]{memory}[/red]" if row.memory_gib > capacity_gib else memory,
                      *((f"{row.host_gib_per_node:.1f}",) if offload else ()),
                      f"{row.traffic.shard_group / GIB:.3f}", f"{row.traffic.all_reduce / GIB:.3f}",
                      f"{row.compute_s * 1e3:.1f}", f"{row.communication_s * 1e3:.1f}", f"{row.step_s * 1e3:.1f}",
                      f"{row.samples_per_s_per_gpu:,.0f}", ", ".join(marks))
    return table


def plan_model_line(plan: "Plan", intra_gbps: float, inter_gbps: float) -> str:
    """The inputs and assumptions behind plan's numbers."""
    from fsdpclip.plan.mesh import EXPOSED_FRACTION, MEMORY_MARGIN

    return (f"model: {plan.parameters:,} parameters, {plan.flops_per_sample / 1e9:,.3g} GFLOP per sample (forward + "
            f"backward) at {plan.tflops:g} TFLOP/s sustained; ring collectives at {intra_gbps:g} Gb/s per GPU inside "
            f"a node and {inter_gbps:g} across nodes; a step is max(compute, communication) + {EXPOSED_FRACTION:g} × "
            f"communication (docs/architecture.md, 'The mesh and the plan model'). 'auto' takes the smallest shard "
            f"group of at least a node that fits {plan.gpu_memory_gib:g} GiB with a {MEMORY_MARGIN:.0%} margin. Host "
            f"memory of the first node (rank processes, offloaded state, checkpoint staging, initial weights): "
            f"{', '.join(sorted({f'{row.host_gib_per_node:.1f}' for row in plan.rows}, key=float))} GiB.")


def report_lines(info: dict) -> list[str]:
    """`report`'s summary: state, progress and ETA, checkpoint, launches and restarts, last results (rich markup,
    the run's own text escaped)."""
    total = f"/{info['total_steps']:,}" if info["total_steps"] else ""
    lines = [f"[bold]{escape(info['run_dir'])}[/bold]: {info['state']}"
             + (f" ({escape(info['holder'])})" if info["holder"] else "")]
    progress = f"step {info['step']:,}{total}"
    if info["eta_s"] is not None:
        hours, rest = divmod(int(info["eta_s"]), 3600)
        progress += f", about {hours}:{rest // 60:02d}:{rest % 60:02d} to go"
    if info["loss"] is not None:
        progress += f", loss {info['loss']:.4g}"
    lines.append(progress)
    lines.append(f"last complete checkpoint: {info['last_checkpoint'] or 'none'}")
    restarts = f", resumed at step {', '.join(map(str, info['restarts_at']))}" if info["restarts_at"] else ""
    lines.append(f"launches: {info['launches']}{restarts}")
    if info.get("data_bound"):
        lines.append(f"[yellow]{escape(info['data_bound'])}[/yellow]")
    if info["exit"] and not info["holder"]:
        lines.append(f"last exit: code {info['exit']['code']}: {escape(str(info['exit']['message']))}")
    if info["relaunch"]:
        lines.append(f"{'resume' if info['last_checkpoint'] else 'launch again'}: {escape(info['relaunch'])}")
    from fsdpclip.jobspec.task import EVAL_TASKS

    lines += [escape(task.line(name, values)) for kind, task in EVAL_TASKS.members().items()
              for name, values in info.get(kind, {}).items()]
    if info["png"] is not None:
        lines.append(f"curves ({', '.join(info['panels'])}): {escape(info['png'])}")
    return lines


def environment_table(found: dict) -> Table:
    """`fsdpclip env`'s report (`validate.environment.environment`) as one table; the GPU topology is printed
    below it."""
    table = Table(title="fsdpclip env", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("found")
    torch = found["torch"]
    rows = [("fsdpclip", found["fsdpclip"]), ("python", f"{found['python']} ({found['platform']})"),
            *found["packages"].items(), *found["extras"].items(),
            ("CUDA (torch)",
             f"{torch['cuda'] or 'none'} ({'available' if torch['cuda_available'] else 'not available'})"),
            ("NCCL (torch)", torch["nccl"] or "none")]
    gpus = found["gpus"]
    rows.append(("GPUs", f"{gpus['count']}: {gpus['source']}"))
    rows += [(f"  GPU {gpu['index']}", f"{gpu['name']}, {gpu['memory_gib']:g} GiB, compute {gpu['capability']}")
             for gpu in gpus["devices"]]
    rows.append(("InfiniBand", ", ".join(_infiniband_device(device) for device in found["infiniband"]) or "none"))
    slurm = found["slurm"]
    rows.append(("Slurm", f"sbatch {slurm['sbatch'] or 'not on PATH'}, srun {slurm['srun'] or 'not on PATH'}"))
    rows += [(f"  {name}", value) for name, value in slurm["job"].items()]
    cores = found["cpu_cores"]
    rows += [("CPU cores", f"{cores['usable']} usable of {cores['total']}"),
             ("host memory", f"{found['host_memory_gib']:g} GiB")]
    root = found["run_root"]
    rows.append(("run root", f"{root['path']}: " + (f"writable, {root['free_gib']:g} GiB free" if root["writable"]
                                                      else f"not writable ({root['why']})")))
    for what, value in rows:
        table.add_row(escape(what), escape(str(value)))
    return table


def _infiniband_device(device: dict) -> str:
    ports = "; ".join(f"port {port['port']} {port['state']} {port['rate']}" for port in device["ports"])
    return f"{device['name']} ({ports})"
