"""What `fsdpclip validate` checks beyond structure: the job's meaning, on the meta device.

Every check adds `Problem`s with JSON locations instead of raising, so that a user sees
every mistake at once. Nothing here allocates real model storage or touches a GPU.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, TypeVar

from fsdpclip.data.urls import MAX_SHARDS, ShardPatterns, is_local, local_path, scheme_problem
from fsdpclip.eval.tasks import EvalTask, eval_tasks
from fsdpclip.model.build import Tower, build_tokenizer, find_towers, model_config, model_from_config, original_shapes, \
    text_shape
from fsdpclip.model.published import FETCH_HINT, cached_weights, hub_cache, hub_offline, quick_gelu_mismatch, tag_problem
from fsdpclip.model.towers import HF_WEIGHT_FILES, TIMM_WEIGHT_FILES, hf_max_tokens
from fsdpclip.model.trainable import DecayGroup, apply_freeze, frozen_names, rule_matches, slice_problem, \
    trainable_decay_groups
from fsdpclip.model.weights import usable_cores
from fsdpclip.parallel.cuda_graphs import uncapturable_modules
from fsdpclip.parallel.parallelize import COMPILE_MIN_BLOCK_TFLOP, auto_compiles, resolve_auto
from fsdpclip.parallel.units import wrap_classes
from fsdpclip.problems import MAX_WORLD_SIZE, ModelError, Report, closest
from fsdpclip.run.files import special_file
from fsdpclip.spec.job import TOWERS, Job, WebDatasetSpec, world_size_problem
from fsdpclip.validate.summary import summarise

T = TypeVar("T")


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
              check_paths: bool = True) -> Report:
    """Check everything `validate` promises; returns a Report (never raises for a user's mistake).

    The world defaults to the spec's launch section; `check_paths=False` skips the existence of data,
    eval and weight files (paths of another machine). Where the launch section did not parse and no world
    is given, the checks that count ranks are skipped (the report's world size is 0).
    """
    if world_size is None:
        world_size, gpus_per_node = if_parsed(layout_of, job) or (0, 0)
    report = Report(world_size, gpus_per_node or world_size)
    if world_size > MAX_WORLD_SIZE:  # nodes × GPUs of flags each within it; every check below counts through ranks
        report.error("launch", world_size_problem(world_size))
        return report
    for check in (_check_precision, _check_cuda_graph, _check_compile_options, _check_eval):
        if_parsed(check, job, report)
    steps = None
    if world_size:
        if_parsed(_check_global_batch, job, report)
        steps = if_parsed(_check_batch_and_schedule, job, report)
    if_parsed(_check_learning_rate, job, report)
    usable_run_dir = if_parsed(_check_output_dir, job, report)
    if_parsed(_check_data, job, report, check_paths)
    if check_paths:
        if_parsed(_check_files, job, report)
        if_parsed(_check_workers_against_cores, job, report)
        if_parsed(_check_eval_paths, job, report)
        if usable_run_dir and job.__dict__.keys() >= Job.model_fields.keys():  # a checkpoint meets a whole spec
            if_parsed(_check_resume, job, report)
    if_parsed(_check_logging, job, report)
    if_parsed(_check_model, job, report, steps, check_paths)
    return report


def if_parsed(check: Callable[..., T], job: Job, *args) -> Optional[T]:
    """Run one check, or skip it (None) when it reads a section of the job that did not parse (a Job from
    `jobfile.salvaged_job`): every check whose sections parsed still runs, so one round shows every mistake."""
    try:
        return check(job, *args)
    except AttributeError as exc:
        if isinstance(exc.obj, Job) and exc.name in Job.model_fields:
            return None
        raise


def _check_logging(job: Job, report: Report) -> None:
    if job.logging.tensorboard:
        _check_importable("tensorboard", "logging.tensorboard", report)
    if job.logging.wandb is not None and job.logging.wandb.mode != "disabled":
        _check_importable("wandb", "logging.wandb", report, extra="wandb")


def _check_model(job: Job, report: Report, steps: Optional[int], check_paths: bool) -> None:
    """The model on the meta device: its text input, classes, freeze ranges, decay groups, then the summary."""
    try:
        cfg = model_config(job.model)
        model = model_from_config(cfg, device="meta")
    except ModelError as exc:
        _model_problem(job, exc, report)
        return
    _check_published(job, cfg, report, check_paths)
    text_ok = _check_text_input(job, cfg, model, report)
    if_parsed(_check_uncapturable, job, model, report)
    towers = find_towers(model, job.model.block_classes)
    if_parsed(_check_compile_options_used, job, model, towers, report)
    classes_ok = if_parsed(_check_classes, job, towers, report)
    if_parsed(_check_freeze, job, towers, report)
    frozen = if_parsed(lambda job: frozen_names(towers, job.freeze) if not report.errors else set(), job)
    if frozen is None:
        return
    apply_freeze(model, frozen)
    groups = if_parsed(_check_decay, job, model, report)
    if_parsed(_check_loss_fits, job, model, report)
    if classes_ok and text_ok and groups is not None and report.world_size:
        if_parsed(summarise, job, model, towers, frozen, groups, steps, report)


def _check_uncapturable(job: Job, model, report: Report) -> None:
    if job.fsdp.cuda_graph is True and (uncapturable := uncapturable_modules(model)):
        report.error("fsdp.cuda_graph", f"cannot capture the model's patch dropout ({uncapturable[0]}: its kept "
                                        f"patches are drawn on the host)", True,
                     hint="leave it 'auto', or set model.image.patch_dropout to 0")


def _check_loss_fits(job: Job, model, report: Report) -> None:
    if job.loss.kind == "siglip" and getattr(model, "logit_bias", None) is None:
        report.error("loss.kind", "SigLIP needs a model with a learned logit bias (init_logit_bias in its config)",
                     value="siglip", hint="use a *-SigLIP model config, or kind 'clip'")


# ----------------------------------------------------------------------- the model
def _model_problem(job: Job, exc: ModelError, report: Report) -> None:
    import open_clip

    if exc.location == "model.name" and exc.message.startswith("unknown OpenCLIP model"):
        near = closest(job.model.name, open_clip.list_models(), n=3, cutoff=0.5)
        report.error("model.name", "unknown OpenCLIP model", job.model.name,
                     f"closest: {near}" if near else "see open_clip.list_models()")
    elif exc.location is not None:
        report.error(exc.location, exc.message, exc.value, exc.hint)
    else:
        report.error("model.config" if job.model.config else "model.name" if job.model.name else "model",
                     exc.message, job.model.config or job.model.name)


def _check_published(job: Job, cfg: dict, report: Report, check_paths: bool) -> None:
    """A published tag in model.pretrained: OpenCLIP publishes it for model.name, with the model's activation,
    and (`check_paths`) the Hugging Face cache holds it, or the hub may be asked for it at launch."""
    name, tag = job.model.name, job.model.published_tag
    if tag is None:
        return
    problem = tag_problem(name, tag)
    if problem:
        report.error("model.pretrained", problem[0], tag, problem[1])
        return
    model_quick_gelu = bool(cfg.get("quick_gelu", False))
    mismatch = quick_gelu_mismatch(name, tag, model_quick_gelu)
    if mismatch:
        import open_clip

        renamed = name.removesuffix("-quickgelu") if model_quick_gelu else f"{name}-quickgelu"
        report.warn("model.pretrained", mismatch, tag,
                    hint=f"use model.name '{renamed}'" if renamed in open_clip.list_models() and renamed != name else
                    f"set model.quick_gelu {str(not model_quick_gelu).lower()}")
    if check_paths and cached_weights(name, tag) is None:
        if hub_offline():
            report.error("model.pretrained", f"not in the Hugging Face cache ({hub_cache()}) and HF_HUB_OFFLINE is set",
                         tag, FETCH_HINT.format(name=name, tag=tag))
        else:
            report.warn("model.pretrained", f"not in the Hugging Face cache ({hub_cache()}) yet: fsdpclip launch "
                        "fetches it before training starts", tag, hint=f"or now: fsdpclip fetch {name} {tag}")


def _check_text_input(job: Job, cfg: dict, model, report: Report) -> bool:
    """A Hugging Face tower: its local tokenizer loads and fits the model; the context fits the model."""
    if "hf_model_name" not in cfg["text_cfg"]:
        return True
    errors = len(report.errors)
    location = "model.text.hf.path" if job.model.text.hf else "model.name" if job.model.name else "model.config"
    context, vocab = text_shape(model)
    limit = hf_max_tokens(model)
    if limit is not None and context > limit:
        report.error("model.text.context_length", f"{context} tokens, but the text tower takes at most {limit}",
                     context)
    try:
        tokenizer = build_tokenizer(cfg).tokenizer
    except (OSError, ValueError, TypeError, KeyError) as exc:
        report.error(location, f"no usable tokenizer there: {str(exc).strip()[:200]}",
                     cfg["text_cfg"]["hf_tokenizer_name"], hint="save the tokenizer (save_pretrained) beside config.json")
        return False
    if len(tokenizer) > vocab:
        report.error(location, f"its tokenizer has {len(tokenizer):,} tokens, more than the model's vocab_size "
                     f"{vocab:,}", cfg["text_cfg"]["hf_tokenizer_name"])
    return len(report.errors) == errors


def _check_classes(job: Job, towers: dict[str, Tower], report: Report) -> bool:
    """Block, wrap and checkpoint classes must exist in their tower."""
    ok = True
    for name in TOWERS:
        tower = towers[name]
        existing = sorted(tower.classes)
        block_like = sorted(set(tower.block_classes) & tower.classes) or existing
        checks = [
            (f"model.{name}.block_classes", getattr(job.model, name).block_classes),
            (f"fsdp.wrap.{name}", getattr(job.fsdp.wrap, name)),
            (f"fsdp.activation_checkpointing.{name}", getattr(job.fsdp.activation_checkpointing, name)),
        ]
        for location, classes in checks:
            for i, cls in enumerate(classes if isinstance(classes, list) else []):
                if cls not in tower.classes:
                    ok = False
                    near = closest(cls, existing)
                    report.error(f"{location}[{i}]", f"no module of class '{cls}' in the {name} tower", cls,
                                 (f"did you mean '{near}'? " if near else "") + f"block classes: {', '.join(block_like)}")
        if not wrap_classes(job.fsdp, tower):
            report.warn(f"fsdp.wrap.{name}", f"the {name} tower has no known block class: it is sharded with the "
                        "root as one unit", hint=f"name its block class; classes: {', '.join(existing[:12])}")
    return ok


def _check_freeze(job: Job, towers: dict[str, Tower], report: Report) -> None:
    for name in TOWERS:
        blocks = getattr(job.freeze, name).blocks
        if blocks is None:
            continue
        length = len(towers[name].blocks)
        why = slice_problem(blocks, length) if length else f"the {name} tower has no blocks to freeze"
        if why:
            report.error(f"freeze.{name}.blocks", why, blocks)


def _check_decay(job: Job, model, report: Report) -> list[DecayGroup]:
    """Every rule matches a parameter; every trainable parameter lands in exactly one group."""
    rules = job.optimizer.decay_rules
    shapes = original_shapes(model)
    for i, rule in enumerate(rules):
        if not any(rule_matches(rule, name, len(shape)) for name, shape in shapes.items()):
            report.error(f"optimizer.decay_rules[{i}]", "matches no parameter of the model",
                         rule.pattern if rule.pattern is not None else f"max_ndim={rule.max_ndim}",
                         hint=f"parameter names look like '{next(iter(shapes))}'")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    groups = trainable_decay_groups(model, job.optimizer)
    grouped = [name for g in groups for name in g.names]
    if sorted(grouped) != sorted(trainable):
        report.error("optimizer.decay_rules", "internal: optimizer groups do not partition the trainable parameters")
    if not trainable:
        report.error("freeze", "every parameter is frozen: nothing to train")
    return groups


# ------------------------------------------------------------- batch and schedule
def _check_global_batch(job: Job, report: Report) -> None:
    """batch.global_batch, where given, is what per_gpu, grad_accum and the world size make."""
    batch, world = job.batch, report.world_size
    global_batch = job.samples_per_step(world)
    if batch.global_batch is not None and batch.global_batch != global_batch:
        report.error("batch.global_batch", f"per_gpu {batch.per_gpu} × grad_accum {batch.grad_accum} × world size "
                     f"{world} = {global_batch}", batch.global_batch,
                     hint=_batch_hint(batch.global_batch, batch.per_gpu, world))


def _check_batch_and_schedule(job: Job, report: Report) -> Optional[int]:
    """The schedule's length against the batches an epoch holds; returns total optimizer steps when known."""
    batch, world = job.batch, report.world_size
    global_batch = job.samples_per_step(world)
    if job.epoch_samples(world) == 0 and (isinstance(job.data, WebDatasetSpec) or job.schedule.steps is None):
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
    return steps


def _check_learning_rate(job: Job, report: Report) -> None:
    """The cosine decays from optimizer.lr to schedule.min_lr: a floor above the peak would turn it into a rise."""
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
    timm_weights = job.model.image.timm.pretrained if job.model.image.timm else None
    paths = [("model.pretrained", None if job.model.published_tag else job.model.pretrained),
             ("model.image.pretrained", job.model.image.pretrained),
             ("model.text.pretrained", job.model.text.pretrained),
             ("model.image.timm.pretrained", timm_weights if isinstance(timm_weights, str) else None)]
    resume = job.checkpoint.resume
    if resume not in (None, "latest"):
        paths.append(("checkpoint.resume", resume))
    for location, path in paths:
        if path is not None and not Path(path).exists():
            report.error(location, "file not found", path)
        elif path is not None and location != "checkpoint.resume" and (kind := special_file(Path(path))):
            report.error(location, f"not a regular file but {kind}", path)
    owned = [("model.text.hf.pretrained", job.model.text.hf, HF_WEIGHT_FILES),
             ("model.image.timm.pretrained", job.model.image.timm, TIMM_WEIGHT_FILES)]
    for location, tower, files in owned:  # weights that live in the tower's own directory
        if tower is not None and tower.pretrained is True and tower.path and \
                not any((Path(tower.path) / f).is_file() for f in files):
            report.error(location, f"no weights in {tower.path}", True, hint=f"expected one of {', '.join(files)}")


CHECKED_SHARDS = 1000  # at most this many shard URLs are looked at (evenly spread over a larger set)


def _check_workers_against_cores(job: Job, report: Report) -> None:
    """The data workers of every rank of a node against the cores this machine lets fsdpclip use (said once
    here instead of by each rank's DataLoader)."""
    workers = getattr(job.data, "workers", 0)
    cores, ranks = usable_cores(), report.gpus_per_node
    if workers * ranks > cores:
        report.warn("data.workers", f"{workers} workers × {ranks} ranks per node = {workers * ranks} data workers, "
                    f"more than the {cores} cores here: they will share cores", workers,
                    hint=(f"at most {cores // ranks} per rank fits" if cores >= ranks else "the ranks alone outnumber "
                          "the cores") + ", unless the nodes that train have more cores")


def _check_data(job: Job, report: Report, check_paths: bool) -> None:
    """Shard URLs the reader can open (their scheme), not too many and enough of them for the ranks and
    workers, and, with `check_paths`, the local ones present: counted without expanding them, and a sample
    of CHECKED_SHARDS looked at when there are more."""
    data = job.data
    if not isinstance(data, WebDatasetSpec):
        return
    try:
        shards = ShardPatterns(data.urls)
    except ValueError as exc:
        report.error("data.urls", str(exc), data.urls, hint="every '{' needs its '}' (a literal one is written '\\{')")
        return
    count = shards.count
    if count > MAX_SHARDS:
        report.error("data.urls", f"{count:,} shards, more than a job may read ({MAX_SHARDS:,}: every rank holds "
                     "the list)", data.urls, hint="pack the data into fewer, larger shards, or check the brace range")
        return
    sample = shards.sample(CHECKED_SHARDS)
    of = f"{len(sample):,} checked (of {count:,})" if len(sample) < count else f"{count:,}"
    unreadable = [(u, problem) for u in sample for problem in [scheme_problem(u)] if problem]
    if unreadable:
        url, (message, hint) = unreadable[0]
        report.error("data.urls", f"{message}: {len(unreadable)} of {of} shards", url, hint=hint)
    missing = [u for u in sample if check_paths and is_local(u) and not Path(local_path(u)).is_file()]
    if missing:
        report.error("data.urls", f"{len(missing)} of {of} shards not found", missing[0],
                     hint="check the path and the brace range" if len(missing) < len(sample) else
                     "paths are relative to the directory you run fsdpclip in")
    needed = report.world_size * max(1, data.workers)
    if not data.resampled and count < needed:  # each worker of each rank reads shards of its own
        report.error("data.urls", f"{count} shards for {report.world_size} ranks × {max(1, data.workers)} "
                     f"workers: some workers would get none (shards must be ≥ world size × data.workers, as "
                     f"OpenCLIP requires)", count,
                     hint=f"use ≥ {needed} shards, fewer workers, or data.resampled")


def _check_eval(job: Job, report: Report) -> None:
    for where, task, spec, named_before in _eval_sets(job):
        task.check(spec, where, report)
        if named_before:
            report.error(where, f"a second set named '{spec.label}'", hint="give each set a `name`")
    if job.eval.every_steps is not None and not job.eval.sets:
        report.error("eval.every_steps", "set, but eval.zeroshot and eval.retrieval list no dataset",
                     job.eval.every_steps)


def _check_eval_paths(job: Job, report: Report) -> None:
    for where, task, spec, _ in _eval_sets(job):
        task.check_paths(spec, where, report)


def _eval_sets(job: Job) -> Iterator[tuple[str, EvalTask, Any, bool]]:
    """(JSON location, task, spec, whether an earlier set of its task has its name) of each set in eval's lists."""
    for kind, task in eval_tasks().items():
        specs = getattr(job.eval, kind, [])
        for i, spec in enumerate(specs):
            yield f"eval.{kind}[{i}]", task, spec, spec.label in {s.label for s in specs[:i]}


def _check_resume(job: Job, report: Report) -> None:
    """What resuming the run directory's checkpoint would mean: errors for what a checkpoint fixes
    (its model, frozen ranges, loss kind, decay groups), a warning for each other change (applied from
    its step), and for each checkpoint that cannot be loaded."""
    from fsdpclip.checkpoint.sharded import CheckpointError, read_meta, resume_candidates
    from fsdpclip.launch.launcher import resolve_paths
    from fsdpclip.spec.resume import checkpoint_changes, is_fixed, shard_fingerprint

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
    for change in checkpoint_changes(meta, resolved, config, lambda: shard_fingerprint(resolved)):
        if is_fixed(change):
            report.error(change.field, f"differs from {checkpoint}, which was trained with {change.before!r}",
                         change.after, hint="resume it with the checkpoint's own value, or start a new run "
                                            "(another run.name, or checkpoint.resume null)")
        else:
            report.warn(change.field, f"changed since {checkpoint.name} ({change}): applied from step {meta['step']}",
                        change.after)


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
    if not os.access(existing, os.W_OK | os.X_OK):
        report.error("run.output_dir", "cannot create the run directory: no write permission", str(existing))
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
        report.error("fsdp.cuda_graph", "not supported with fp16 loss scaling", True, hint="leave it 'auto' or use bf16")


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


def _check_compile_options_used(job: Job, model, towers: dict[str, Tower], report: Report) -> None:
    """A warning where `fsdp.compile_options` would go unused: nothing compiled, or compile 'auto' deciding at
    start from a block's work (parallelize.resolve_auto, asked here as if the blocks did none)."""
    fsdp = job.fsdp
    if not fsdp.compile_options or fsdp.compile is True:
        return
    if fsdp.compile is False or not auto_compiles(towers, job.launch.device):
        why = "fsdp.compile is false" if fsdp.compile is False else \
            "compile 'auto' is off on the CPU and for other libraries' blocks"
        report.warn("fsdp.compile_options", f"unused: {why}", hint="set fsdp.compile to true to compile")
    elif not resolve_auto(fsdp, model, towers, job.launch.device, 0.0, world_size=report.world_size).compile:
        report.warn("fsdp.compile_options", "unused where compile 'auto' leaves blocks eager: it compiles them where "
                                            "the step is CUDA-graphed or a block's forward is at least "
                                            f"{COMPILE_MIN_BLOCK_TFLOP} TFLOP (decided at start)",
                    hint="set fsdp.compile to true to compile in any case")


def compile_option_problem(name: str, value) -> Optional[tuple[str, Optional[str]]]:
    """(message, hint) where torch.compile would refuse `value` for the inductor option `name`, or take a value
    its declared type does not allow (torch checks plain types only: literals and unions are checked here); None
    where it fits."""
    from torch._inductor import config

    declared = config.get_type(name)
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
