"""`fsdpclip eval`, `export` and `import`: a checkpoint evaluated by an eval task (each registered task is a
flag: `fsdpclip.jobspec.task.EVAL_TASKS`), written as one OpenCLIP checkpoint, or continued from open_clip_train's."""

from __future__ import annotations

import inspect
import json
import shlex
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from fsdpclip.cli.console import WithRegisteredOptions, check_destination, console, fail, option, stop
from fsdpclip.jobspec.problems import SpecError


class EvalPrecision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


def eval_command(
    checkpoint: Path = typer.Argument(
        ..., help="A run or checkpoint directory, an exported OpenCLIP file or local-dir."),
    data: Optional[Path] = typer.Option(None, "--data", help="Its folder: class folders, or CLIP_benchmark shards."),
    model: Optional[str] = typer.Option(None, "--model", help="OpenCLIP name, for an exported file."),
    model_config: Optional[Path] = typer.Option(
        None, "--model-config", help="Model-config JSON, for an exported file."),
    classnames: Optional[Path] = typer.Option(None, "--classnames", help="One class name per line (folder sets)."),
    templates: Optional[str] = typer.Option(
        None, "--templates", help="'openai', 'simple' or a file of '{c}' templates."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Images per forward and process."),
    workers: Optional[int] = typer.Option(None, "--workers", min=0,
                                          help="Data loading workers per process (default: up to 4, one per core)."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", min=1, help="Evaluate at most this many images."),
    precision: EvalPrecision = typer.Option(EvalPrecision.fp32, "--precision", help="fp32, or bf16 (autocast / FSDP)."),
    output: Optional[Path] = typer.Option(None, "--output", help="Write CLIP_benchmark's JSON here."),
    ema: bool = typer.Option(False, "--ema", help="The moving average of the weights (a run's `ema` block) instead "
                                                  "of the weights trained."),
    **task_flags,
) -> None:
    """Zero-shot accuracy or retrieval recall of a checkpoint, in CLIP_benchmark's JSON format (torchrun: sharded)."""
    import os

    from pydantic import ValidationError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from fsdpclip.checkpoint.layout import CheckpointError
    from fsdpclip.eval.evaluate import evaluate_checkpoint
    from fsdpclip.jobspec.task import EVAL_TASKS, DatasetError
    from fsdpclip.jobspec.problems import ModelError

    tasks = EVAL_TASKS.members()
    picked = [(tasks[kind], value) for kind, value in task_flags.items() if value is not None]
    if len(picked) != 1:
        usages = [task.usage for task in tasks.values()]
        stop(f"give {', '.join(usages[:-1])} or {usages[-1]}" if len(usages) > 1 else f"give {usages[0]}")
    task, value = picked[0]
    try:
        spec = task.spec_from_flags(getattr(value, "value", value), None if data is None else str(data),
                                    None if classnames is None else str(classnames), templates, max_samples)
    except ValidationError as exc:
        stop(_validation_line(exc))
    except ValueError as exc:
        stop(str(exc))
    if output is not None and os.environ.get("RANK", "0") == "0":
        check_destination(output)
    bar = Progress(TextColumn(f"[bold]{task.title} {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=console, disable=os.environ.get("RANK", "0") != "0")

    def progress(name: str, total: Optional[int]):
        bar_task = bar.add_task(escape(name), total=total)
        return lambda done: bar.advance(bar_task, done)

    try:
        with bar:
            record = evaluate_checkpoint(checkpoint, spec, model, None if model_config is None else str(model_config),
                                         precision.value, batch_size, workers, progress, averaged=ema)
    except ValidationError as exc:
        stop(_validation_line(exc))
    except (ModelError, CheckpointError, DatasetError) as exc:
        stop(str(exc))
    if record is None:  # not rank 0
        return
    samples, texts = record.pop("samples"), record.pop("texts", None)
    for note in task.notes(record):
        console.print(f"[yellow]![/yellow] {escape(note)}", highlight=False, soft_wrap=True)
    counted = f"{samples} images" + (f", {texts} captions" if texts is not None else "")
    weights = " (its moving average)" if ema else ""
    table = Table(title=escape(f"{task.title} {record['dataset']}: {record['model']}{weights} ({counted})"))
    columns, rows = task.table(record["metrics"])
    for column in columns:
        table.add_column(column, justify="right" if column else "left")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if output is not None:
        try:
            output.write_text(json.dumps(record) + "\n")
        except OSError as exc:
            stop(f"cannot write {output}: {exc.strerror or exc}")
        console.print(f"[green]✓[/green] {escape(str(output))}", highlight=False, soft_wrap=True)


def _validation_line(exc) -> str:
    """pydantic's ValidationError as one line: each field and what is wrong with it."""
    return "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())


def task_options() -> list[inspect.Parameter]:
    """A flag per eval task: `--KIND VALUE`, VALUE one of its choices where it has them."""
    from fsdpclip.jobspec.task import EVAL_TASKS

    options = []
    for kind, task in EVAL_TASKS.members().items():
        value_type = Enum(kind, {choice: choice for choice in task.choices}, type=str) if task.choices else str
        options.append(option(kind, Optional[value_type], typer.Option(None, f"--{kind}", help=task.flag_help,
                                                                       metavar=None if task.choices else task.metavar)))
    return options


evaluate = WithRegisteredOptions(eval_command, task_options, after="checkpoint")


class ExportFormat(str, Enum):
    open_clip = "open_clip"
    hf = "hf"


def export(
    checkpoint: Path = typer.Argument(..., help="A run directory (its latest checkpoint) or one checkpoint directory."),
    out: Path = typer.Argument(..., help="OUT.pt / OUT.safetensors, or a directory for open_clip's 'local-dir:' "
                                         "(--format hf: a directory)."),
    safetensors: bool = typer.Option(False, "--safetensors", help="Write safetensors instead of a torch pickle "
                                                                  "(--format hf always does)."),
    export_format: ExportFormat = typer.Option(ExportFormat.open_clip, "--format",
                                               help="open_clip, or hf: a transformers CLIPModel directory."),
    force: bool = typer.Option(False, "--force", help="Overwrite what OUT holds."),
    ema: bool = typer.Option(False, "--ema", help="The moving average of the weights (the run's `ema` block) "
                                                  "instead of the weights trained."),
) -> None:
    """Write a sharded checkpoint as one OpenCLIP checkpoint (a weights file, with the model config OpenCLIP
    registers beside it where OpenCLIP does not know the model, or a local-dir) or as a transformers CLIPModel
    directory (--format hf), and the Python that loads it."""
    if export_format is ExportFormat.hf:
        return _export_hf(checkpoint, out, force, ema)
    from fsdpclip.checkpoint.layout import CheckpointError, read_meta, required_averages, resolve_checkpoint
    from fsdpclip.checkpoint.whole import (WEIGHTS_SUFFIXES, export_checkpoint, exported_files, holds_model_config,
                                          open_clip_name)
    from fsdpclip.model.build import model_from_config

    try:
        source = resolve_checkpoint(checkpoint)
        if ema:
            required_averages(source)
        for path in exported_files(out, safetensors):  # before the checkpoint is read
            check_destination(path, overwrite=force)
        meta = read_meta(source)
        config = meta["model"]["open_clip_config"]
        name, registered = open_clip_name(config, meta["model"]["label"], out)
        config_name = name if registered and out.suffix in WEIGHTS_SUFFIXES else None
        for path in exported_files(out, safetensors, config_name)[:-1]:  # and the config beside a weights file
            if not holds_model_config(path, config):
                check_destination(path, overwrite=force)
        written = export_checkpoint(source, model_from_config(config, device="meta"), out, config,
                                    safetensors=safetensors, config_name=config_name, averaged=ema)
    except CheckpointError as exc:
        stop(str(exc))
    except OSError as exc:
        stop(f"cannot write {out}: {exc.strerror or exc}")
    done = f"{source} (step {meta['step']}{AVERAGE_NOTE if ema else ''}) → {written}" + (
        f", its model config {name}.json beside it" if config_name else "")
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)
    if out.suffix not in WEIGHTS_SUFFIXES:
        steps = [f"create_model_and_transforms({repr(f'local-dir:{out.resolve()}')})"]
    else:
        register = [f"add_model_config({str(written.with_name(f'{name}.json').resolve())!r})"] if config_name else []
        steps = [*register, f"create_model_and_transforms({name!r}, pretrained={str(written.resolve())!r})"]
    *first, create = (f"open_clip.{step}" for step in steps)
    load = "; ".join(["import open_clip", *first, f"model, _, preprocess = {create}"])
    console.print(f"in Python: {escape(load)}", highlight=False, soft_wrap=True)


AVERAGE_NOTE = ", its moving average"  # what the line of an export says of --ema


def _export_hf(checkpoint: Path, out: Path, force: bool, ema: bool) -> None:
    """`export --format hf`: the checkpoint's model (`ema`: its moving average) as a transformers CLIPModel
    directory, or one line saying which key of its model config CLIPModel has no place for."""
    from fsdpclip.checkpoint.layout import CheckpointError, read_meta, required_averages, resolve_checkpoint
    from fsdpclip.checkpoint.whole import WEIGHTS_SUFFIXES, read_model_state
    from fsdpclip.interop.hf_clip import HF_WEIGHTS, hf_files, hf_refusal, write_hf
    from fsdpclip.model.build import OpenClip, model_from_config

    if out.suffix in WEIGHTS_SUFFIXES:
        stop(f"--format hf writes a directory, not {out.name}: give OUT without {out.suffix}")
    try:
        source = resolve_checkpoint(checkpoint)
        if ema:
            required_averages(source)
        meta = read_meta(source)
        config = meta["model"]["open_clip_config"]
        refusal = hf_refusal(config)
        if refusal:
            stop(f"cannot export {source} as a transformers CLIPModel: model config {refusal}")
        model: OpenClip = model_from_config(config, device="meta")
        files, notes = hf_files(config, model.visual.preprocess_cfg)
        for name in (*files, HF_WEIGHTS):  # before the checkpoint is read
            check_destination(out / name, overwrite=force)
        write_hf(out, read_model_state(source, model, averaged=ema), config, files)
    except CheckpointError as exc:
        stop(str(exc))
    except OSError as exc:
        stop(f"cannot write {out}: {exc.strerror or exc}")
    done = f"{source} (step {meta['step']}{AVERAGE_NOTE if ema else ''}) → {out} (transformers CLIPModel)"
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)
    for note in notes:
        console.print(f"  {escape(note)}", highlight=False, soft_wrap=True)
    path = repr(str(out.resolve()))
    load = f"from transformers import CLIPModel; model = CLIPModel.from_pretrained({path})"
    if not notes:
        load += f"; from transformers import CLIPProcessor; processor = CLIPProcessor.from_pretrained({path})"
    console.print(f"in Python: {escape(load)}", highlight=False, soft_wrap=True)


def import_command(
    checkpoint: Path = typer.Argument(..., help="open_clip_train's epoch_N.pt or epoch_latest.pt."),
    job_file: Path = typer.Argument(
        ..., help="The job spec that continues it (its run directory holds no checkpoint)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
) -> None:
    """Continue an open_clip_train run: write its checkpoint (weights, AdamW moments, step) into the job's run
    directory, which `fsdpclip launch` then resumes."""
    from fsdpclip.checkpoint.layout import CheckpointError
    from fsdpclip.interop.open_clip_train import import_open_clip_train
    from fsdpclip.launch.launcher import resolve_paths
    from fsdpclip.jobspec.problems import ModelError
    from fsdpclip.run.directory import IMPORT_FILE
    from fsdpclip.run.lock import RunLocked
    from fsdpclip.jobspec.jobfile import load_job
    from fsdpclip.validate.checks import check_job, spec_error_problems

    try:
        job = load_job(job_file, overrides)
        report = check_job(job)
        if report.errors:
            fail(report.problems)
    except SpecError as exc:
        fail(spec_error_problems(exc))
    job = resolve_paths(job, Path.cwd())
    try:
        imported = import_open_clip_train(checkpoint, job)
    except (CheckpointError, ModelError, RunLocked) as exc:
        stop(str(exc))
    except OSError as exc:
        stop(f"cannot write into {job.run_dir}: {exc.strerror or exc}")
    for note in imported.notes:
        console.print(f"[yellow]![/yellow] {escape(note)}", highlight=False, soft_wrap=True)
    launch = shlex.join(["fsdpclip", "launch", str(job_file), *(part for o in overrides for part in ("--set", o))])
    done = (f"{checkpoint} (epoch {imported.epoch}) → {imported.checkpoint} (step {imported.step} of "
            f"{imported.total_steps}; notes in {job.run_dir / IMPORT_FILE}); continue with `{launch}`")
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)
