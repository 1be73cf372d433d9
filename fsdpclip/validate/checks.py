"""What `fsdpclip validate` checks beyond structure: the job's meaning, on the meta device.

Every check adds `Problem`s with JSON locations instead of raising, so that a user sees
every mistake at once. Nothing here allocates real model storage or touches a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Optional

from fsdpclip.jobspec.source import DATA_SOURCES
from fsdpclip.jobspec.task import EVAL_TASKS, EvalTask
from fsdpclip.model.build import model_config
from fsdpclip.model.trainable import frozen_meta_model
from fsdpclip.model.weights import check_weights_file
from fsdpclip.run.node import usable_cores
from fsdpclip.plan.memory import GIB
from fsdpclip.jobspec.problems import MAX_WORLD_SIZE, ModelError, Problem, Report, SpecError, closest
from fsdpclip.run.files import special_file
from fsdpclip.jobspec.job import (
    DECAY_LENGTHS, FINAL_DECAY, Job, ScheduleSpec, is_url, largest_divisor, world_size_problem,
)
from fsdpclip.validate.model_checks import check_model, if_parsed


def layout_of(job: Job, world_size: Optional[int] = None, nodes: Optional[int] = None,
              gpus_per_node: Optional[int] = None) -> tuple[int, int]:
    """(world size, ranks per node) to check against: from nodes × GPUs (flags over the spec), or an
    explicit world size laid out in nodes of launch.gpus_per_node (one node when they do not tile it)."""
    if world_size is not None:
        per_node = job.launch.gpus_per_node
        return world_size, per_node if world_size % per_node == 0 else world_size
    per_node = gpus_per_node or job.launch.gpus_per_node
    return (nodes or job.launch.nodes) * per_node, per_node


def check_job(job: Job, world_size: Optional[int] = None, gpus_per_node: Optional[int] = None,
              check_paths: bool = True, check_remote: bool = False, on_this_node: bool = False,
              whole: bool = True) -> Report:
    """Check everything `validate` promises; returns a Report (never raises for a user's mistake).

    The world defaults to the spec's launch section; `check_paths=False` skips the existence of data,
    eval and weight files (paths of another machine); `check_remote` reaches the object storage the
    checkpoints go to (credentials, reachability); `on_this_node`: the job's first node is this machine (a
    launch here), whose memory then bounds the host estimate (else a warning where paths are checked here).
    `whole`: the spec parsed whole, as comparing it with its run's checkpoint needs (not so for the Job of
    `spec_error_problems`). Where the launch section's layout did not parse and no world is given, the checks
    that count ranks are skipped (the report's world size is 0).
    """
    if world_size is None:
        world_size, gpus_per_node = if_parsed(layout_of, job) or (0, 0)
    report = Report(world_size, gpus_per_node or world_size)
    if world_size > MAX_WORLD_SIZE:  # nodes × GPUs of flags each within it; every check below counts through ranks
        report.error("launch", world_size_problem(world_size))
        return report
    for check in (_check_precision, _check_cuda_graph, _check_float8, _check_compile_options, _check_eval):
        if_parsed(check, job, report)
    steps, searched, auto, spec_job = None, if_parsed(lambda job: job.batch.searched, job), None, job
    if world_size and searched:
        job, auto = if_parsed(_auto_batch_start, job, report) or (job.with_batch(1, job.batch.grad_accum), None)
    if world_size and not (searched and auto is None):
        if_parsed(_check_global_batch, job, report)
        steps = if_parsed(_check_batch_and_schedule, job, report)
    if world_size:
        if_parsed(_check_shard_degree, job, report)
    if_parsed(_check_learning_rate, job, report)
    usable_run_dir = if_parsed(_check_output_dir, job, report)
    if_parsed(_check_data, job, report, check_paths)
    if_parsed(_check_tower_families, job, report, check_paths)
    if_parsed(_check_remote, job, report, check_remote)
    if check_paths:
        if_parsed(_check_files, job, report)
        if_parsed(_check_workers_against_cores, job, report)
        if_parsed(_check_eval_paths, job, report)
        if usable_run_dir and whole:
            if_parsed(_check_resume, spec_job, report)
    if_parsed(_check_logging, job, report)
    if_parsed(check_model, job, report, steps, check_paths,
              "error" if on_this_node else "warning" if check_paths else None)
    if searched and "batch" in report.summary:
        report.summary["batch"]["auto"] = auto
    return report


def spec_error_problems(error: SpecError, world_size: Optional[int] = None, nodes: Optional[int] = None,
                        gpus_per_node: Optional[int] = None, **options) -> list[Problem]:
    """Every problem of a spec that did not load: its own (`error.problems`), then `check_job`'s of what parsed
    (`error.salvaged`; `options` as `check_job` takes them), for the world `layout_of` lays out: one round shows
    every mistake."""
    if error.salvaged is None:
        return error.problems
    layout = if_parsed(layout_of, error.salvaged, world_size, nodes, gpus_per_node) or (world_size, None)
    return error.problems + check_job(error.salvaged, *layout, whole=False, **options).problems


def _check_logging(job: Job, report: Report) -> None:
    if job.logging.tensorboard:
        _check_importable("tensorboard", "logging.tensorboard", report)
    if job.logging.wandb is not None and job.logging.wandb.mode != "disabled":
        _check_importable("wandb", "logging.wandb", report, extra="wandb")


# ------------------------------------------------------------- batch and schedule
def _check_global_batch(job: Job, report: Report) -> None:
    """batch.global_batch, where given, is what per_gpu, grad_accum and the world size make."""
    batch, world = job.batch, report.world_size
    global_batch = job.samples_per_step(world)
    if batch.global_batch is not None and batch.global_batch != global_batch:
        report.error("batch.global_batch", f"per_gpu {batch.per_gpu} × grad_accum {batch.grad_accum} × world size "
                     f"{world} = {global_batch}", batch.global_batch,
                     hint=_batch_hint(batch.global_batch, batch.settled_per_gpu, world))


def _check_shard_degree(job: Job, report: Report) -> None:
    """A shard degree given as a number fits the world: it divides it, and a group lies inside a node or spans
    whole nodes."""
    from fsdpclip.plan.mesh import shard_degree_problem, valid_shard_degrees

    chosen, world, per_node = job.fsdp.shard_degree, report.world_size, report.gpus_per_node
    if chosen != "auto" and (problem := shard_degree_problem(chosen, world, per_node)):
        report.error("fsdp.shard_degree", problem, chosen, hint=f"valid for {world // per_node} node(s) × {per_node}: "
                     f"{', '.join(map(str, valid_shard_degrees(world, per_node)))} (or 'auto')")


def _auto_batch_start(job: Job, report: Report) -> tuple[Job, Optional[dict]]:
    """`batch.per_gpu: "auto"`: the job with the batch the start-up search begins from (the memory estimate's
    largest that fits launch.gpu_memory_gib, else this node's GPU; 1 per GPU where neither is known), for the
    checks and summary that count samples, and what `validate` shows of it; (the job at 1 per GPU, None)
    where 'auto' cannot run (a located problem) or the model does not build (check_model says why)."""
    from fsdpclip.plan.resolved import Node, plan_for_node

    batch, world, per_node = job.batch, report.world_size, report.gpus_per_node
    problems, unsettled = len(report.errors), (job.with_batch(1, batch.grad_accum), None)
    if job.launch.device == "cpu":
        report.error("batch.per_gpu", "'auto' probes steps on the GPU; launch.device is 'cpu'", "auto",
                     hint="give a number of samples per rank")
    if batch.global_batch is not None and batch.global_batch % world:
        report.error("batch.global_batch", f"not a multiple of the world size {world}, as per_gpu 'auto' needs",
                     batch.global_batch)
    if batch.global_batch is not None and batch.grad_accum != 1:
        report.error("batch.grad_accum", "set by the search when per_gpu is 'auto' and global_batch is given",
                     batch.grad_accum, hint="leave it out")
    if job.fsdp.shard_degree == "auto" and world > per_node:
        report.error("fsdp.shard_degree", "'auto' over several nodes is decided from the batch, which per_gpu 'auto' "
                     "decides from the shard degree", "auto", hint="give a shard degree with per_gpu 'auto'")
    if len(report.errors) > problems:
        return unsettled
    capacity = job.launch.gpu_memory_gib * GIB if job.launch.gpu_memory_gib else _local_gpu_bytes()
    try:
        model, towers = frozen_meta_model(model_config(job.model), job)
        plan = plan_for_node(job, model, towers, Node(world, per_node, job.launch.device, gpu_bytes=capacity))
    except Exception:  # noqa: BLE001  (check_model reports a model that does not build or run, or the degree)
        return unsettled
    start = plan.per_gpu if capacity else None
    shown = {"start": start, "capacity_gib": round(capacity / GIB, 1) if capacity else None}
    if batch.global_batch is None:
        return job.with_batch(start or 1, batch.grad_accum), shown
    share = batch.global_batch // world
    per_gpu = largest_divisor(share, start or 1)
    return job.with_batch(per_gpu, share // per_gpu), shown


def _local_gpu_bytes() -> Optional[int]:
    """The memory of this node's first GPU, or None without one."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _check_batch_and_schedule(job: Job, report: Report) -> Optional[int]:
    """The schedule's length against the batches an epoch holds; returns total optimizer steps when known."""
    batch, world = job.batch, report.world_size
    global_batch = job.samples_per_step(world)
    if job.epoch_samples(world) == 0 and (DATA_SOURCES[job.data.source].counts_epochs or job.schedule.steps is None):
        report.error("data.samples", f"fewer samples than one micro batch on every rank (batch.per_gpu "
                     f"{batch.per_gpu} × world size {world} = {batch.per_gpu * world}): an epoch holds no batch",
                     job.data.samples)
        return None
    steps = job.total_steps(world)
    if steps is None:
        report.error("schedule", "the length is unknown: set schedule.steps, or data.samples with schedule.epochs")
        return None
    if steps == 0:
        report.error("data.samples", f"fewer samples than one global batch ({global_batch})", job.data.samples)
        return None
    if job.schedule.warmup_steps > steps:
        report.error("schedule.warmup_steps", f"longer than the whole run ({steps} steps)", job.schedule.warmup_steps)
    elif job.schedule.kind in FINAL_DECAY:
        _check_final_decay(job.schedule, steps, report)
    return steps


def _check_final_decay(schedule: ScheduleSpec, steps: int, report: Report) -> None:
    """The final decay is at least a step and follows the warmup within the run."""
    field = next(name for name in DECAY_LENGTHS if getattr(schedule, name) is not None)
    decay, warmup = schedule.decay_length(steps), schedule.warmup_steps
    if decay == 0:
        report.error(f"schedule.{field}", f"a decay of no step in the run's {steps} steps", getattr(schedule, field))
    elif warmup + decay > steps:
        report.error(f"schedule.{field}", f"a decay of {decay} steps after {warmup} warmup steps does not fit in the "
                     f"run's {steps} steps", getattr(schedule, field),
                     hint=f"at most {steps - warmup} steps of decay, or fewer warmup steps")


def _check_learning_rate(job: Job, report: Report) -> None:
    """The cosine and the final decays go from optimizer.lr to schedule.min_lr: a floor above the peak would turn them
    into a rise."""
    if job.schedule.min_lr > job.optimizer.lr:
        report.error("schedule.min_lr", f"above the peak learning rate optimizer.lr {job.optimizer.lr:g}",
                     job.schedule.min_lr, hint="the floor must be at most optimizer.lr")


def _batch_hint(global_batch: int, per_gpu: int, world: int) -> str:
    if global_batch % (per_gpu * world) == 0:
        return f"grad_accum {global_batch // (per_gpu * world)} gives it"
    if global_batch % world == 0:
        return f"per_gpu {global_batch // world} with grad_accum 1 gives it"
    return f"it is not a multiple of the world size {world}"


# ------------------------------------------------------------------ files and data
def _check_files(job: Job, report: Report) -> None:
    paths = [("model.pretrained", None if job.model.published_tag else job.model.pretrained),
             ("model.image.pretrained", job.model.image.pretrained),
             ("model.text.pretrained", job.model.text.pretrained)]
    resume = job.checkpoint.resume
    if resume not in (None, "latest") and not is_url(resume):
        paths.append(("checkpoint.resume", resume))
    for location, path in paths:
        if path is not None and not Path(path).exists():
            report.missing(location, "file not found", path)
        elif path is not None and location != "checkpoint.resume" and (kind := special_file(Path(path))):
            report.error(location, f"not a regular file but {kind}", path)
        elif path is not None and location != "checkpoint.resume" and Path(path).is_file():
            try:
                check_weights_file(path)
            except ModelError as exc:
                report.error(location, exc.message, path)
            except OSError as exc:
                report.error(location, f"cannot read: {exc.strerror or exc}", path)


def _check_workers_against_cores(job: Job, report: Report) -> None:
    """The data workers of every rank of a node against the cores this machine lets fsdpclip use (said once
    here instead of by each rank's DataLoader)."""
    cores, ranks = usable_cores(), report.gpus_per_node
    settle = getattr(job.data, "settled_workers", None)
    workers = settle(report.world_size, ranks, cores) if settle is not None else 0
    if workers * ranks > cores:
        report.warn("data.workers", f"{workers} workers × {ranks} ranks per node = {workers * ranks} data workers, "
                    f"more than the {cores} cores here: they will share cores", workers,
                    hint=(f"at most {cores // ranks} per rank fits" if cores >= ranks else "the ranks alone outnumber "
                          "the cores") + ", unless the nodes that train have more cores")


def _check_data(job: Job, report: Report, check_paths: bool) -> None:
    DATA_SOURCES[job.data.source].check(job.data, job, report, check_paths)


def _check_tower_families(job: Job, report: Report, check_paths: bool) -> None:
    for family, block in filter(None, (job.model.image.family, job.model.text.family)):
        family.check(block, report, check_paths)


def _check_eval(job: Job, report: Report) -> None:
    for where, task, spec, named_before in _eval_sets(job):
        task.check(spec, where, report)
        if named_before:
            report.error(where, f"a second set named '{spec.label}'", hint="give each set a `name`")
    if job.eval.every_steps is not None and not job.eval.sets:
        lists = " and ".join(f"eval.{kind}" for kind in EVAL_TASKS.members())
        report.error("eval.every_steps", f"set, but {lists} list no dataset", job.eval.every_steps)
    if job.eval.ema and job.moving_average is None:
        report.error("eval.ema", "evaluates the averaged weights of the `ema` block, and `ema` is 'auto' (none are "
                     "kept)", True, hint='give an `ema` block, e.g. "ema": {"decay": 0.9999}')


def _check_eval_paths(job: Job, report: Report) -> None:
    for where, task, spec, _ in _eval_sets(job):
        task.check_paths(spec, where, report)


def _eval_sets(job: Job) -> Iterator[tuple[str, EvalTask, Any, bool]]:
    """(JSON location, task, spec, whether an earlier set of its task has its name) of each set in eval's lists."""
    for kind, task in EVAL_TASKS.members().items():
        specs = getattr(job.eval, kind)
        for i, spec in enumerate(specs):
            yield f"eval.{kind}[{i}]", task, spec, spec.label in {s.label for s in specs[:i]}


def _check_remote(job: Job, report: Report, check_remote: bool) -> None:
    """checkpoint.remote and a resume URL: the fsspec package each needs installed; with `check_remote`, the
    remote folder listed and written, and the resume URL's checkpoint found (nothing is downloaded)."""
    from fsdpclip.checkpoint.layout import CheckpointError
    from fsdpclip.checkpoint.remote import RemoteFolder, backend_problem, error_line, remote_checkpoint

    spec = job.checkpoint
    for location, url in (("checkpoint.remote", spec.remote), ("checkpoint.resume", spec.resume)):
        if url is None or not is_url(url):
            continue
        problem = backend_problem(url)
        if problem is not None:
            report.error(location, problem[0], url, hint=problem[1])
            continue
        if not check_remote:
            continue
        try:
            if location == "checkpoint.remote":
                problem = RemoteFolder(url, spec.remote_options).access_problem()
            else:
                remote_checkpoint(url, spec.remote_options)
        except CheckpointError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001  (fsspec's backends fail in their own exception types)
            problem = f"cannot be read: {error_line(exc)}"
        if problem is not None:
            report.error(location, problem, url, hint="checkpoint.remote_options and the credentials in the "
                                                      "environment (AWS_*, Google's default credentials)")


def kept_on_resume(job: Job) -> Job:
    """`job` as resuming its run directory's checkpoint trains it on the spec's world size: with the checkpoint's
    global batch where that differs (`jobspec.resume.kept_batch`); as it is without a (local, readable) checkpoint."""
    from fsdpclip.checkpoint.layout import CheckpointError, read_meta, resume_candidates
    from fsdpclip.launch.launcher import resolve_paths
    from fsdpclip.jobspec.resume import kept_batch

    if job.checkpoint.resume is not None and is_url(job.checkpoint.resume):
        return job
    resolved = resolve_paths(job, Path.cwd())
    try:
        candidates, _ = resume_candidates(resolved.run_dir, resolved.checkpoint.resume)
        return kept_batch(job, read_meta(candidates[0]), job.launch.world_size) if candidates else job
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):  # said by _check_resume
        return job


def _check_resume(job: Job, report: Report) -> None:
    """What resuming the run directory's checkpoint would mean: errors for what a checkpoint fixes
    (its model, frozen ranges, loss kind, decay groups) and for what changes the run itself unless accepted
    (its global batch, length or LR at the resume step: `jobspec.resume.consequences`), a warning for each other
    change (applied from its step), and for each checkpoint that cannot be loaded. A resume URL is not
    downloaded to be checked."""
    from fsdpclip.checkpoint.layout import CheckpointError, read_meta, resume_candidates
    from fsdpclip.launch.launcher import resolve_paths
    from fsdpclip.jobspec.resume import checkpoint_changes, is_fixed, shard_fingerprint, unaccepted

    if job.checkpoint.resume is not None and is_url(job.checkpoint.resume):
        return
    resolved = resolve_paths(job, Path.cwd())
    try:
        candidates, skipped = resume_candidates(resolved.run_dir, resolved.checkpoint.resume)
    except CheckpointError as exc:
        report.error("checkpoint.resume", str(exc), resolved.checkpoint.resume)
        return
    for warning in skipped:
        report.warn("checkpoint.resume", warning)
    if not candidates:
        return
    checkpoint, meta = candidates[0], read_meta(candidates[0])
    try:
        config = model_config(resolved.model)
    except ModelError:  # reported by the model's own check
        config = None
    changes = checkpoint_changes(meta, resolved, config, lambda: shard_fingerprint(resolved))
    refused = unaccepted(changes, resolved)
    for change in changes:
        if is_fixed(change):
            report.error(change.field, f"differs from {checkpoint}, which was trained with {change.before!r}",
                         change.after, hint="resume it with the checkpoint's own value, or start a new run "
                                            "(another run.name, or checkpoint.resume null)")
        elif change in refused:
            report.error(change.field, f"resuming {checkpoint.name} changes the run: {change.note}", change.after,
                         hint="--accept-changes to resume so (checkpoint.accept_changes), or relaunch as the "
                              "checkpoint's spec and ranks would go on")
        else:
            report.warn(change.field, f"changed since {checkpoint.name} ({change}): applied from step {meta['step']}",
                        change.after)


def longest_run_file() -> str:
    """The longest path below a run directory that a run writes: a rank's file in a checkpoint being saved, at a
    ten-digit step of a world of 2^20 ranks."""
    from fsdpclip.checkpoint.layout import CHECKPOINTS, PARTIAL_SUFFIX, checkpoint_name

    return f"{CHECKPOINTS}/{checkpoint_name(10 ** 9)}{PARTIAL_SUFFIX}/__{MAX_WORLD_SIZE}_0.distcp"


def _check_output_dir(job: Job, report: Report) -> bool:
    """The run directory exists or can be made; whether it can be used."""
    existing = job.run_dir
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
    except OSError as exc:  # a name too long for the filesystem, a path through a file, ...
        report.error("run.output_dir", f"cannot hold a run directory: {exc.strerror or exc}", job.run.output_dir)
        return False
    if not existing.is_dir():
        report.error("run.output_dir", "not a directory", str(existing))
        return False
    longest = len(os.fsencode(Path(os.path.abspath(job.run_dir)) / longest_run_file()))
    limit = os.pathconf(existing, "PC_PATH_MAX")
    if longest >= limit:  # the limit counts the terminating NUL
        report.error("run.output_dir", f"too long a path for the files a run writes: {longest:,} bytes with the "
                                       f"longest of them, the filesystem allows {limit - 1:,}", job.run.output_dir,
                     hint="a shorter run.output_dir or run.name")
        return False
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write into the run directory" if existing == job.run_dir else "create the run directory"
        why = "a read-only filesystem" if os.statvfs(existing).f_flag & os.ST_RDONLY else "no write permission"
        report.error("run.output_dir", f"cannot {what}: {why}", str(existing))
        return False
    return True


def _check_precision(job: Job, report: Report) -> None:
    fsdp = job.fsdp
    scaler = fsdp.grad_scaler.enabled
    if fsdp.param_dtype == "fp16" and scaler is False:
        report.error("fsdp.grad_scaler.enabled", "fp16 training without loss scaling underflows gradients", False,
                     hint="leave it 'auto' (a sharding-aware dynamic scaler) or use bf16")
    if fsdp.param_dtype != "fp16" and scaler is True:
        report.error("fsdp.grad_scaler.enabled", f"loss scaling is for fp16, not {fsdp.param_dtype}", True,
                     hint="leave it 'auto'")
    if {fsdp.param_dtype, fsdp.reduce_dtype} == {"bf16", "fp16"}:
        report.error("fsdp.reduce_dtype", f"mixes fp16 and bf16 with param_dtype {fsdp.param_dtype}",
                     fsdp.reduce_dtype, hint="reduce in fp32 or in the param dtype")
    if job.launch.device == "cpu" and fsdp.param_dtype == "fp16":
        report.error("fsdp.param_dtype", "fp16 is not supported on CPU", "fp16", hint="use bf16 or fp32")


def _check_cuda_graph(job: Job, report: Report) -> None:
    """What `fsdp.cuda_graph: true` cannot capture, known from the spec (patch dropout: from the model)."""
    fsdp = job.fsdp
    if fsdp.cuda_graph is not True:
        return
    if job.launch.device != "cuda":
        report.error("fsdp.cuda_graph", "CUDA graphs need CUDA devices", True, hint="leave it 'auto'")
    if fsdp.cpu_offload:
        report.error("fsdp.cuda_graph", "cannot capture a step with CPU offload (it waits for the host)", True,
                     hint="leave it 'auto' or turn fsdp.cpu_offload off")
    if fsdp.scales_loss:
        report.error("fsdp.cuda_graph", "not supported with fp16 loss scaling", True,
                     hint="leave it 'auto' or use bf16")


def _check_float8(job: Job, report: Report) -> None:
    """What `fsdp.float8: true` needs that the spec tells: CUDA GPUs, bf16 parameters and torchao (the GPUs'
    compute capability is a check of the node they are on: `validate.preflight`, and the ranks')."""
    fsdp = job.fsdp
    if fsdp.float8 is not True:
        return
    if job.launch.device != "cuda":
        report.error("fsdp.float8", "float8 GEMMs need CUDA GPUs; launch.device is 'cpu'", True, hint="leave it 'auto'")
    if fsdp.param_dtype != "bf16":
        report.error("fsdp.float8", f"float8 layers train with bf16 parameters, not {fsdp.param_dtype}", True,
                     hint="set fsdp.param_dtype to bf16, or leave fsdp.float8 'auto'")
    _check_importable("torchao", "fsdp.float8", report, extra="float8")


def _check_compile_options(job: Job, report: Report) -> None:
    """`fsdp.compile_options`: each an option of the installed torch's inductor that torch.compile can set to
    that value (`compile_option_problem`), one spelling per option, not inductor's own CUDA graphs inside a
    step fsdpclip captures."""
    fsdp = job.fsdp
    if not fsdp.compile_options:
        return
    from torch._inductor import config

    captured = fsdp.cuda_graph is True or (fsdp.cuda_graph == "auto" and job.launch.device == "cuda"
                                           and report.world_size == 1)
    known, seen = config.get_config_copy(), {}
    for key, value in fsdp.compile_options.items():
        name, location = key.replace("-", "_"), f"fsdp.compile_options.{key}"
        if name in seen:
            report.error(location, f"the same option as '{seen[name]}'", value, hint="give it once")
        elif name not in known:
            near = closest(name, known)
            report.error(location, "not an option of the installed torch's inductor (torch._inductor.config)",
                         hint=f"did you mean '{near}'?" if near else "dynamo's settings are not inductor options")
        elif problem := compile_option_problem(name, value):
            report.error(location, problem[0], value, hint=problem[1])
        elif name == "triton.cudagraphs" and value and captured:
            report.error(location, "inductor's CUDA graphs cannot be recorded inside a step fsdpclip captures "
                                   "(fsdp.cuda_graph)", value, hint="set fsdp.cuda_graph to false to use them")
        seen.setdefault(name, key)


def compile_option_problem(name: str, value) -> Optional[tuple[str, Optional[str]]]:
    """(message, hint) where torch.compile would refuse `value` for the inductor option `name`, or take a value
    its declared type does not allow (torch checks plain types only: literals and unions are checked here); None
    where it fits."""
    from torch._inductor import config

    declared = config.get_type(name)  # pyright: ignore[reportAttributeAccessIssue]  (set up at import)
    if isinstance(declared, str):
        return "torch.compile cannot set this option on this torch (its declared type is not one it can check)", None
    if declared is type(None) and value is not None:
        return "torch.compile can only set this option to null on this torch (no type is declared for it)", None
    if _fits(value, declared) is False:
        hint = f"write {float(value)!r}" if declared is float and isinstance(value, int) else None
        return f"must be {_type_name(declared)}, not {value!r}", hint
    return None


def _fits(value, declared) -> Optional[bool]:
    """Whether `value` is of the `declared` type (plain types, literals, unions); None where that cannot be told."""
    import types
    import typing

    origin = typing.get_origin(declared)
    if origin is None:
        return isinstance(value, declared) if isinstance(declared, type) else None
    if origin is typing.Literal:
        return value in typing.get_args(declared)
    if origin in (typing.Union, types.UnionType):
        fits = [_fits(value, member) for member in typing.get_args(declared)]
        return True if True in fits else None if None in fits else False
    return isinstance(value, origin) if isinstance(origin, type) else None


def _type_name(declared) -> str:
    return declared.__name__ if isinstance(declared, type) else str(declared).replace("typing.", "")


def _check_importable(module: str, location: str, report: Report, extra: Optional[str] = None) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        hint = f"pip install 'fsdpclip[{extra}]'" if extra else f"pip install {module}"
        report.error(location, f"needs the '{module}' package", hint=hint)
