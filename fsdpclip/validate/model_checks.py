"""`validate`'s checks of the model section, on the meta device: it builds, its text input, its block, wrap and
checkpoint classes, freeze ranges and decay groups, published weights; then `validate`'s summary.
"""

from __future__ import annotations

from typing import Callable, Optional, TypeVar

from fsdpclip.model.build import Tower, build_tokenizer, find_towers, model_config, model_from_config, \
    original_shapes, text_shape, training_config
from fsdpclip.model.published import (
    FETCH_HINT, cached_weights, hub_cache, hub_offline, quick_gelu_mismatch, tag_problem,
)
from fsdpclip.model.towers import hf_max_tokens
from fsdpclip.model.trainable import DecayGroup, apply_freeze, frozen_names, rule_matches, slice_problem, \
    trainable_decay_groups
from fsdpclip.parallel.cuda_graphs import uncapturable_modules
from fsdpclip.parallel.parallelize import COMPILE_MIN_BLOCK_TFLOP, auto_compiles
from fsdpclip.model.units import wrap_classes
from fsdpclip.jobspec.problems import ModelError, Report, closest
from fsdpclip.jobspec.job import TOWERS, Job
from fsdpclip.jobspec.section import Section
from fsdpclip.jobspec.losses import LOSSES
from fsdpclip.validate.summary import summarise

T = TypeVar("T")


def if_parsed(check: Callable[..., T], job: Job, *args) -> Optional[T]:
    """Run one check, or skip it (None) when it reads a section or field of the job that did not parse (a Job from
    `jobfile.salvaged_job`): every check whose fields parsed still runs, so one round shows every mistake."""
    try:
        return check(job, *args)
    except AttributeError as exc:
        if isinstance(exc.obj, Section) and exc.name in type(exc.obj).model_fields:
            return None
        raise


def check_model(job: Job, report: Report, steps: Optional[int], check_paths: bool,
                this_machine: Optional[str] = None) -> None:
    """The model on the meta device: its text input, classes, freeze ranges, decay groups, then the summary
    (`this_machine`: how a host estimate over this machine's memory is reported, 'error' or 'warning')."""
    try:
        cfg = if_parsed(training_config, job) or model_config(job.model)  # data not parsed: the model's preprocessing
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
    freeze_ok = if_parsed(_check_freeze, job, towers, report)
    frozen = if_parsed(lambda job: frozen_names(towers, job.freeze), job) if freeze_ok else None
    apply_freeze(model, frozen or set())  # a freeze that is wrong or did not parse freezes nothing here
    groups = if_parsed(_check_decay, job, model, report)
    if_parsed(_check_loss_fits, job, model, report)
    if frozen is not None and classes_ok and text_ok and groups is not None and report.world_size:
        if_parsed(summarise, job, model, towers, frozen, groups, steps, report, this_machine)


def _check_uncapturable(job: Job, model, report: Report) -> None:
    if job.fsdp.cuda_graph is True and (uncapturable := uncapturable_modules(model)):
        report.error("fsdp.cuda_graph", f"cannot capture the model's patch dropout ({uncapturable[0]}: its kept "
                                        f"patches are drawn on the host)", True,
                     hint="leave it 'auto', or set model.image.patch_dropout to 0")


def _check_loss_fits(job: Job, model, report: Report) -> None:
    LOSSES[job.loss.kind].check(job.loss, model, report)


def _model_problem(job: Job, exc: ModelError, report: Report) -> None:
    import open_clip

    if exc.location == "model.name" and exc.message.startswith("unknown OpenCLIP model"):
        near = closest(job.model.name or "", open_clip.list_models(), n=3, cutoff=0.5)
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
    assert name is not None  # a tag without a name is tag_problem's
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
    from open_clip.tokenizer import HFTokenizer

    errors = len(report.errors)
    family = job.model.text.family  # the tower family that replaced the config's text tower, if any
    location = "model.text.hf.path" if family and family[0].name == "hf" else "model.name" if job.model.name else \
        "model.config"
    context, vocab = text_shape(model)
    limit = hf_max_tokens(model)
    if limit is not None and context > limit:
        report.error("model.text.context_length", f"{context} tokens, but the text tower takes at most {limit}",
                     context)
    try:
        hf_tokenizer = build_tokenizer(cfg)
        assert isinstance(hf_tokenizer, HFTokenizer)  # a Hugging Face tower's
        tokenizer = hf_tokenizer.tokenizer
    except (OSError, ValueError, TypeError, KeyError) as exc:
        report.error(location, f"no usable tokenizer there: {str(exc).strip()[:200]}",
                     cfg["text_cfg"]["hf_tokenizer_name"],
                     hint="save the tokenizer (save_pretrained) beside config.json")
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
                                 (f"did you mean '{near}'? " if near else "")
                                 + f"block classes: {', '.join(block_like)}")
        if not wrap_classes(getattr(job.fsdp.wrap, tower.name), tower):
            report.warn(f"fsdp.wrap.{name}", f"the {name} tower has no known block class: it is sharded with the "
                        "root as one unit", hint=f"name its block class; classes: {', '.join(existing[:12])}")
    return ok


def _check_freeze(job: Job, towers: dict[str, Tower], report: Report) -> bool:
    """Each tower's frozen blocks lie among its blocks; whether they all do."""
    errors = len(report.errors)
    for name in TOWERS:
        blocks = getattr(job.freeze, name).blocks
        if blocks is None:
            continue
        length = len(towers[name].blocks)
        why = slice_problem(blocks, length) if length else f"the {name} tower has no blocks to freeze"
        if why:
            report.error(f"freeze.{name}.blocks", why, blocks)
    return len(report.errors) == errors


def _check_decay(job: Job, model, report: Report) -> Optional[list[DecayGroup]]:
    """Every rule matches a parameter; a tower with layer decay has OpenCLIP main's layer groups; every trainable
    parameter lands in exactly one group."""
    rules = job.optimizer.decay_rules
    shapes = original_shapes(model)
    for i, rule in enumerate(rules):
        if not any(rule_matches(rule, name, len(shape)) for name, shape in shapes.items()):
            report.error(f"optimizer.decay_rules[{i}]", "matches no parameter of the model",
                         rule.pattern if rule.pattern is not None else f"max_ndim={rule.max_ndim}",
                         hint=f"parameter names look like '{next(iter(shapes))}'")
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        report.error("freeze", "every parameter is frozen: nothing to train")
    try:
        groups = trainable_decay_groups(model, job.optimizer)
    except ModelError as exc:
        report.error(exc.location or "optimizer", exc.message, exc.value, exc.hint)
        return None
    grouped = [name for g in groups for name in g.names]
    if sorted(grouped) != sorted(trainable):
        report.error("optimizer.decay_rules", "internal: optimizer groups do not partition the trainable parameters")
    return groups


def _check_compile_options_used(job: Job, model, towers: dict[str, Tower], report: Report) -> None:
    """A warning where `fsdp.compile_options` would go unused: nothing compiled, or compile 'auto' deciding at
    start from a block's work (the run plan's, asked here as if the blocks did none)."""
    fsdp = job.fsdp
    if not fsdp.compile_options or fsdp.compile is True:
        return
    if fsdp.compile is False or not auto_compiles(towers, job.launch.device):
        why = "fsdp.compile is false" if fsdp.compile is False else \
            "compile 'auto' is off on the CPU and for other libraries' blocks"
        report.warn("fsdp.compile_options", f"unused: {why}", hint="set fsdp.compile to true to compile")
    elif not _compiles_without_block_work(job, model, towers, report):
        report.warn("fsdp.compile_options", "unused where compile 'auto' leaves blocks eager: it compiles them where "
                                            "the step is CUDA-graphed or a block's forward is at least "
                                            f"{COMPILE_MIN_BLOCK_TFLOP} TFLOP (decided at start)",
                    hint="set fsdp.compile to true to compile in any case")


def _compiles_without_block_work(job: Job, model, towers: dict[str, Tower], report: Report) -> bool:
    """Whether the run plan compiles where a block's forward is no work at all (whole towers, a graphed step)."""
    from fsdpclip.plan.mesh import ShardDegreeError
    from fsdpclip.plan.resolved import Node, plan_for_node

    node = Node(report.world_size, report.gpus_per_node, job.launch.device)
    try:
        return plan_for_node(job, model, towers, node, flops_per_sample=0.0).layout.compile
    except ShardDegreeError:  # said by check_job
        return True
