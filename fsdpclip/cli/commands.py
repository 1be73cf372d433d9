"""The `fsdpclip` command line: parse arguments, call the library, render with rich."""

from __future__ import annotations

import json
import shlex
import sys
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fsdpclip.problems import MAX_WORLD_SIZE, ModelError, Problem, SpecError

if TYPE_CHECKING:
    from fsdpclip.launch.launcher import LaunchFlags
    from fsdpclip.spec.job import Job, ModelSpec

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Train OpenCLIP models with PyTorch FSDP2 from one JSON job spec.")
data_app = typer.Typer(no_args_is_help=True, help="Build datasets.")
app.add_typer(data_app, name="data", help="Build datasets (the offline digits demo).")
# Logs and pipes get wide lines (rich would wrap them at 80 columns); terminals keep their width.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

USER_ERROR = 2


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from fsdpclip import __version__

        console.print(f"fsdpclip {__version__} (open_clip_torch {version('open_clip_torch')}, torch {version('torch')})",
                      highlight=False)
        raise typer.Exit()


@app.callback()
def _options(_: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                    help="Print the versions of fsdpclip, OpenCLIP and torch, and exit.")) -> None:
    pass


def _fail(problems: list[Problem], as_json: bool = False) -> None:
    """Show problems (table or JSON) and exit with the user-error code."""
    if as_json:
        print(json.dumps({"ok": False, "errors": [p.as_dict() for p in problems if p.severity == "error"],
                          "warnings": [p.as_dict() for p in problems if p.severity == "warning"]}, indent=2))
    else:
        _problem_table(problems, err_console)
    raise typer.Exit(USER_ERROR)


def _stop(message: str) -> None:
    """A mistake outside any spec (a path, a checkpoint): one line, the user-error code."""
    err_console.print(f"[red]✗[/red] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(USER_ERROR)


def _problem_table(problems: list[Problem], out: Console) -> None:
    errors = sum(p.severity == "error" for p in problems)
    title = f"{errors} error{'s' * (errors != 1)}" if errors else "warnings"
    table = Table(title=title, title_style="bold red" if errors else "bold yellow", show_lines=False)
    for column in ("", "location", "problem", "value", "hint"):
        table.add_column(column, overflow="fold")
    for p in problems:
        mark = "[red]✗[/red]" if p.severity == "error" else "[yellow]![/yellow]"
        value = "" if p.value is None else repr(p.value)
        table.add_row(mark, *(escape(text) for text in (p.location, p.message, value, p.hint or "")))
    out.print(table)


@app.command()
def validate(
    job_file: Path = typer.Argument(..., help="The job spec (JSON)."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, max=MAX_WORLD_SIZE,
                                             help="Check for this many ranks."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, max=MAX_WORLD_SIZE, help="Check for this many nodes."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", min=1, max=MAX_WORLD_SIZE,
                                                help="Check for this many GPUs per node."),
    check_paths: bool = typer.Option(True, "--check-paths/--no-check-paths",
                                     help="Check that data, eval and weight files exist (off for cluster paths)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check a job spec and its meaning before any GPU is allocated."""
    from fsdpclip.cli.tables import summary_tables
    from fsdpclip.spec.jobfile import load_job
    from fsdpclip.validate.checks import check_job, if_parsed, layout_of

    if world_size is not None and (nodes is not None or gpus_per_node is not None):
        _fail([Problem("--world-size", "give --world-size or --nodes/--gpus-per-node, not both")], as_json)
    try:
        job = load_job(job_file, overrides)
    except SpecError as exc:  # with what the sections that parsed mean: every mistake in one round
        if exc.salvaged is None:
            _fail(exc.problems, as_json)
        layout = if_parsed(layout_of, exc.salvaged, world_size, nodes, gpus_per_node) or (world_size, None)
        _fail(exc.problems + check_job(exc.salvaged, *layout, check_paths=check_paths).problems, as_json)
    report = check_job(job, *layout_of(job, world_size, nodes, gpus_per_node), check_paths=check_paths)
    if report.errors:
        _fail(report.problems, as_json)
    if as_json:
        print(json.dumps({"ok": True, "errors": [], "warnings": [p.as_dict() for p in report.warnings],
                          "summary": report.summary}, indent=2))
        return
    if report.warnings:
        _problem_table(report.warnings, console)
    for table in summary_tables(report.summary):
        console.print(table)
    console.print(f"[bold green]✓[/bold green] {escape(str(job_file))} is valid for world size {report.world_size}",
                  highlight=False, soft_wrap=True)


@app.command()
def plan(
    job_file: Path = typer.Argument(..., help="The job spec (JSON)."),
    nodes: int = typer.Option(..., "--nodes", min=1, max=MAX_WORLD_SIZE, help="Number of nodes."),
    gpus_per_node: int = typer.Option(..., "--gpus-per-node", min=1, max=MAX_WORLD_SIZE, help="GPUs (ranks) per node."),
    intra_gbps: Optional[float] = typer.Option(None, "--intra-gbps", min=1e-3,
                                               help="Collective bandwidth inside a node, Gb/s per GPU "
                                                    "(default: NVLink's 2880)."),
    inter_gbps: Optional[float] = typer.Option(None, "--inter-gbps", min=1e-3,
                                               help="Collective bandwidth across nodes, Gb/s per GPU "
                                                    "(default: a 400G NDR adapter's 360)."),
    tflops: Optional[float] = typer.Option(None, "--tflops", min=1e-3,
                                           help="Sustained TFLOP/s per GPU (default: what fsdpclip measured)."),
    gpu_memory_gib: Optional[float] = typer.Option(None, "--gpu-memory-gib", min=1e-3,
                                                   help="Memory of one GPU (default: launch.gpu_memory_gib, else "
                                                        "an H200's 139)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Compare the ways to lay a job over NODES x GPUS: replication, HSDP at each shard degree, full FSDP."""
    from dataclasses import asdict

    from fsdpclip.cli.tables import plan_model_line, plan_table
    from fsdpclip.plan.mesh import GPU_MEMORY_GIB, INTER_GBPS, INTRA_GBPS, plan_job
    from fsdpclip.spec.jobfile import load_job
    from fsdpclip.validate.checks import check_job

    try:
        job = load_job(job_file, overrides)
    except SpecError as exc:
        _fail(exc.problems, as_json)
    world = nodes * gpus_per_node
    job = job.model_copy(update={"batch": job.batch.model_copy(update={"global_batch": None})})  # per GPU counts
    report = check_job(job, world, gpus_per_node, check_paths=False)
    # plan prices the model: the degree is what it helps choose, and the data does not enter its numbers
    blocking = [p for p in report.errors if p.location != "fsdp.shard_degree" and not p.location.startswith("data")]
    if blocking:
        _fail(blocking, as_json)
    capacity = gpu_memory_gib or job.launch.gpu_memory_gib or GPU_MEMORY_GIB
    intra_gbps, inter_gbps = intra_gbps or INTRA_GBPS, inter_gbps or INTER_GBPS
    result = plan_job(job, nodes, gpus_per_node, capacity, tflops, intra_gbps, inter_gbps)
    if as_json:
        print(json.dumps(asdict(result) | {"spec_shard_degree": job.fsdp.shard_degree}, indent=2))
        return
    console.print(plan_table(job, result, capacity))
    console.print(plan_model_line(result, intra_gbps, inter_gbps), highlight=False, soft_wrap=True)


@app.command()
def launch(
    job_file: Path = typer.Argument(..., help="The job spec (JSON)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", "--nproc-per-node", min=1, max=MAX_WORLD_SIZE,
                                                help="Processes per node (default: launch.gpus_per_node)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, max=MAX_WORLD_SIZE,
                                        help="Number of nodes (default: launch.nodes)."),
    slurm: bool = typer.Option(False, "--slurm", help="Submit a batch script with sbatch instead of running here."),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition (default: launch.slurm)."),
    time_limit: Optional[str] = typer.Option(None, "--time", help="Slurm time limit (default: launch.slurm)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", min=0,
                                            help="Without Slurm: this node's rank, 0 to --nodes - 1."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Without Slurm: the address of node 0."),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535,
                                              help="Rendezvous port on node 0 (default: launch.master_port)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would run (or the batch script)."),
    check_paths: bool = typer.Option(True, "--check-paths/--no-check-paths",
                                     help="Check that data, eval and weight files exist (off for cluster paths)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
) -> None:
    """Validate a job and run it with torchrun on this node, or submit it to Slurm (--slurm)."""
    from fsdpclip.launch.launcher import (
        LaunchError, LaunchFlags, cuda_forbids_forked_ranks, forking_environment, prepare_forked_ranks, resolve_paths,
        run_local, shown_command,
    )
    from fsdpclip.spec.jobfile import load_job

    flags = LaunchFlags(nodes, gpus_per_node, slurm, partition, time_limit, node_rank, master_addr, master_port,
                        dry_run)
    try:
        flags.check()
        job = load_job(job_file, [*overrides, *flags.overrides()])
        new_interpreters = "Slurm starts them" if slurm else prepare_forked_ranks(job)  # before torch's import
        from fsdpclip.validate.checks import check_job

        report = check_job(job, check_paths=check_paths)
        if report.errors:
            _fail(report.problems)
        if report.warnings:
            _problem_table(report.warnings, console)
        flags.check_nodes(job)
    except SpecError as exc:
        _fail(exc.problems)
    except LaunchError as exc:
        _stop(str(exc))
    job = resolve_paths(job, Path.cwd())
    if not (slurm or dry_run):
        _preflight(job, flags)
    if not dry_run:
        _fetch_published(job.model)
    if slurm:
        _submit(job, dry_run)
        return
    console.print(f"[bold]run directory[/bold] {escape(str(job.run_dir))}", highlight=False, soft_wrap=True)
    new_interpreters = new_interpreters or cuda_forbids_forked_ranks(job)
    fork_ranks = new_interpreters is None
    if new_interpreters:
        console.print(f"[dim]the ranks start as new interpreters: {escape(new_interpreters)}[/dim]", highlight=False)
    console.print(escape(shown_command(flags.torchrun(job, fork_ranks), forking_environment(job, fork_ranks))),
                  highlight=False, soft_wrap=True)
    if dry_run:
        return
    try:
        report = run_local(job, flags, fork_ranks)
    except LaunchError as exc:
        _stop(str(exc))
    _ending(report["code"], report["message"], job.run_dir)


def _preflight(job: Job, flags: LaunchFlags) -> None:
    """This node's checks before any process starts (`preflight`): errors end the launch (exit 2), warnings are
    shown; a run already over ends it as finished, starting nothing."""
    from fsdpclip.run.directory import EXIT_OK
    from fsdpclip.validate.preflight import already_finished, preflight

    static_rendezvous = job.launch.nodes > 1 or flags.master_addr is not None
    report = preflight(job, flags.node_rank or 0, static_rendezvous)
    if report.errors:
        _fail(report.problems)
    if report.warnings:
        _problem_table(report.warnings, console)
    finished = already_finished(job) if (flags.node_rank or 0) == 0 else None
    if finished:
        _ending(EXIT_OK, finished, job.run_dir)


def _ending(code: int, message: str, run_dir: Path) -> None:
    """How a launch ended, its run directory and the commands that come next; exits with `code`."""
    from fsdpclip.run.directory import EXIT_OK, EXIT_PREEMPTED, LOG_DIR

    mark = {EXIT_OK: "[green]✓[/green]", EXIT_PREEMPTED: "[yellow]‖[/yellow]"}.get(code, "[red]✗[/red]")
    relaunch = shlex.join(["fsdpclip", *sys.argv[1:]])
    report = f"fsdpclip report {shlex.quote(str(run_dir))}"
    if code == EXIT_OK:
        follow = [f"next: {report}", f"      fsdpclip eval {shlex.quote(str(run_dir))} --zeroshot folder --data DIR",
                  f"      fsdpclip export {shlex.quote(str(run_dir))} OUT.safetensors --safetensors"]
    elif code == EXIT_PREEMPTED:
        follow = [f"resume: {relaunch}", f"progress: {report}"]
    else:
        follow = [f"logs: {run_dir / LOG_DIR}", f"run again (it resumes from the last checkpoint, if any): {relaunch}",
                  f"progress: {report}"]
    out = console if code == EXIT_OK else err_console
    for line in [f"{mark} {escape(message)}", f"run directory: {escape(str(run_dir))}", *map(escape, follow)]:
        out.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _fetch_published(model: ModelSpec) -> None:
    """Published weights into the Hugging Face cache of this node, once, before any rank starts."""
    from fsdpclip.model.published import fetch

    if model.published_tag is None:
        return
    try:
        with console.status(f"fetching the '{model.published_tag}' weights of {model.name}"):
            file, downloaded = fetch(model.name, model.published_tag)
    except ModelError as exc:
        _stop(f"{exc.location}: {_model_error_line(exc)}")
    if downloaded:
        console.print(f"[green]✓[/green] fetched the '{model.published_tag}' weights of {model.name}: {escape(file)}",
                      highlight=False, soft_wrap=True)


def _model_error_line(exc: ModelError) -> str:
    """A ModelError as one line, its hint after it (plain text: `_stop` escapes it)."""
    return exc.message + (f"; {exc.hint}" if exc.hint else "")


@app.command()
def fetch(
    name: str = typer.Argument(..., help="OpenCLIP architecture, e.g. ViT-B-32."),
    tag: str = typer.Argument(..., help="Its published weights, e.g. laion2b_s34b_b79k (fsdpclip models --pretrained)."),
) -> None:
    """Download OpenCLIP's published weights into the Hugging Face cache (HF_HOME), for model.pretrained."""
    from fsdpclip.model.published import fetch as fetch_weights

    try:
        with console.status(f"fetching the '{tag}' weights of {name}"):
            file, downloaded = fetch_weights(name, tag)
    except ModelError as exc:
        _stop(_model_error_line(exc))
    console.print(f"[green]✓[/green] {'fetched' if downloaded else 'already cached'}: {escape(file)}", highlight=False,
                  soft_wrap=True)


def _submit(job: Job, dry_run: bool) -> None:
    """Write RUN_DIR/job.json and RUN_DIR/launch.sbatch and submit it (or only print the script)."""
    from fsdpclip.launch.launcher import BATCH_SCRIPT, LaunchError, SubmitError, sbatch_script, submit
    from fsdpclip.run.directory import JOB_FILE, LOG_DIR, lock_holder

    try:
        script = sbatch_script(job)
    except LaunchError as exc:
        _stop(str(exc))
    if dry_run:
        print(script, end="")
        return
    holder = lock_holder(job.run_dir)
    if holder is not None:
        _stop(f"{job.run_dir} is in use by {holder}: wait for that job to end or stop it, or give this one "
              "another run.name")
    logs, script_path = job.run_dir / LOG_DIR, job.run_dir / BATCH_SCRIPT
    try:
        logs.mkdir(parents=True, exist_ok=True)
        job.save(job.run_dir / JOB_FILE)
        script_path.write_text(script)
    except OSError as exc:
        _stop(f"cannot use the run directory {job.run_dir}: {exc.strerror or exc}")
    try:
        job_id = submit(script_path)
    except SubmitError as exc:
        _stop(f"sbatch refused {script_path}: {exc}")
    console.print(f"[green]✓[/green] submitted batch job {escape(job_id)} ({job.launch.nodes} node(s) × "
                  f"{job.launch.gpus_per_node} rank(s)): {escape(str(script_path))}", highlight=False, soft_wrap=True)
    console.print(escape(f"logs: {logs}/slurm-{job_id}.out and .err (the batch script), "
                         f"{logs}/slurm-{job_id}-node<N>.out (node N's ranks)"), highlight=False, soft_wrap=True)


@app.command()
def train(job_file: Path = typer.Argument(..., help="The resolved spec, usually RUN_DIR/job.json.")) -> None:
    """Train on this rank (what torchrun starts on every rank)."""
    from fsdpclip.train.entry import main

    raise typer.Exit(main([str(job_file)]))


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="A run directory (its latest checkpoint) or one checkpoint directory."),
    out: Path = typer.Argument(..., help="OUT.pt / OUT.safetensors, or a directory for open_clip's 'local-dir:'."),
    safetensors: bool = typer.Option(False, "--safetensors", help="Write safetensors instead of a torch pickle."),
) -> None:
    """Write a sharded checkpoint as one OpenCLIP checkpoint."""
    from fsdpclip.checkpoint.sharded import CheckpointError, export_checkpoint, read_meta, resolve_checkpoint
    from fsdpclip.model.build import model_from_config

    try:
        source = resolve_checkpoint(checkpoint)
        meta = read_meta(source)
        config = meta["model"]["open_clip_config"]
        written = export_checkpoint(source, model_from_config(config, device="meta"), out, config,
                                    safetensors=safetensors)
    except CheckpointError as exc:
        _stop(str(exc))
    except OSError as exc:
        _stop(f"cannot write {out}: {exc.strerror or exc}")
    done = f"{source} (step {meta['step']}) → {written}"
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)


@app.command("import")
def import_command(
    checkpoint: Path = typer.Argument(..., help="open_clip_train's epoch_N.pt or epoch_latest.pt."),
    job_file: Path = typer.Argument(..., help="The job spec that continues it (its run directory holds no checkpoint)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
) -> None:
    """Continue an open_clip_train run: write its checkpoint (weights, AdamW moments, step) into the job's run
    directory, which `fsdpclip launch` then resumes."""
    from fsdpclip.checkpoint.sharded import CheckpointError
    from fsdpclip.interop.open_clip_train import import_open_clip_train
    from fsdpclip.launch.launcher import resolve_paths
    from fsdpclip.problems import ModelError
    from fsdpclip.run.directory import IMPORT_FILE, RunLocked
    from fsdpclip.spec.jobfile import load_job
    from fsdpclip.validate.checks import check_job

    try:
        job = load_job(job_file, overrides)
        report = check_job(job)
        if report.errors:
            _fail(report.problems)
    except SpecError as exc:
        _fail(exc.problems)
    job = resolve_paths(job, Path.cwd())
    try:
        imported = import_open_clip_train(checkpoint, job)
    except (CheckpointError, ModelError, RunLocked) as exc:
        _stop(str(exc))
    except OSError as exc:
        _stop(f"cannot write into {job.run_dir}: {exc.strerror or exc}")
    for note in imported.notes:
        console.print(f"[yellow]![/yellow] {escape(note)}", highlight=False, soft_wrap=True)
    done = (f"{checkpoint} (epoch {imported.epoch}) → {imported.checkpoint} (step {imported.step} of "
            f"{imported.total_steps}; notes in {job.run_dir / IMPORT_FILE}); continue with `fsdpclip launch {job_file}`")
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)


class ZeroShotKind(str, Enum):
    imagenet = "imagenet"
    digits = "digits"
    folder = "folder"


class EvalPrecision(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"


@app.command("eval")
def eval_command(
    checkpoint: Path = typer.Argument(..., help="A run or checkpoint directory, an exported OpenCLIP file or local-dir."),
    zeroshot: Optional[ZeroShotKind] = typer.Option(None, "--zeroshot", help="Which kind of zero-shot set."),
    data: Optional[Path] = typer.Option(None, "--data", help="Its folder: class folders, or CLIP_benchmark shards."),
    retrieval: Optional[Path] = typer.Option(None, "--retrieval",
                                             help="Instead of --zeroshot: a retrieval set, a folder of image/caption "
                                                  "pairs (x.jpg, x.txt) or CLIP_benchmark retrieval shards."),
    model: Optional[str] = typer.Option(None, "--model", help="OpenCLIP name, for an exported file."),
    model_config: Optional[Path] = typer.Option(None, "--model-config", help="Model-config JSON, for an exported file."),
    classnames: Optional[Path] = typer.Option(None, "--classnames", help="One class name per line (folder sets)."),
    templates: Optional[str] = typer.Option(None, "--templates", help="'openai', 'simple' or a file of '{c}' templates."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Images per forward and process."),
    workers: Optional[int] = typer.Option(None, "--workers", min=0,
                                          help="Data loading workers per process (default: up to 4, one per core)."),
    max_samples: Optional[int] = typer.Option(None, "--max-samples", min=1, help="Evaluate at most this many images."),
    precision: EvalPrecision = typer.Option(EvalPrecision.fp32, "--precision", help="fp32, or bf16 (autocast / FSDP)."),
    output: Optional[Path] = typer.Option(None, "--output", help="Write CLIP_benchmark's JSON here."),
) -> None:
    """Zero-shot accuracy or retrieval recall of a checkpoint, in CLIP_benchmark's JSON format (torchrun: sharded)."""
    import os

    from pydantic import ValidationError
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from fsdpclip.checkpoint.sharded import CheckpointError
    from fsdpclip.eval.evaluate import DatasetError, evaluate_checkpoint
    from fsdpclip.problems import ModelError
    from fsdpclip.spec.job import RetrievalSpec, ZeroShotSpec

    if (zeroshot is None) == (retrieval is None):
        _stop("give --zeroshot KIND --data DIR (classification) or --retrieval DIR (image-text retrieval)")
    if zeroshot is not None and data is None:
        _stop("--zeroshot needs --data DIR, the dataset's folder")
    if retrieval is not None and (data, classnames, templates) != (None, None, None):
        _stop("--data, --classnames and --templates are for --zeroshot; --retrieval takes the dataset's folder itself")
    if output is not None and os.environ.get("RANK", "0") == "0":
        _check_destination(output)
    kind = "zero-shot" if zeroshot is not None else "retrieval"
    bar = Progress(TextColumn(f"[bold]{kind} {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                   TimeRemainingColumn(), console=console, disable=os.environ.get("RANK", "0") != "0")

    def progress(name: str, total: Optional[int]):
        task = bar.add_task(escape(name), total=total)
        return lambda done: bar.advance(task, done)

    try:
        if retrieval is not None:
            spec = RetrievalSpec(path=str(retrieval), max_samples=max_samples)
        else:
            spec = ZeroShotSpec(dataset=zeroshot.value, path=str(data), templates=templates, max_samples=max_samples,
                                classnames=None if classnames is None else str(classnames))
        with bar:
            record = evaluate_checkpoint(checkpoint, spec, model, None if model_config is None else str(model_config),
                                         precision.value, batch_size, workers, progress)
    except ValidationError as exc:
        _stop("; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))
    except (ModelError, CheckpointError, DatasetError) as exc:
        _stop(str(exc))
    if record is None:  # not rank 0
        return
    samples, texts = record.pop("samples"), record.pop("texts", None)
    if "folder_classes" in record:
        pairs = list(record["folder_classes"].items())
        paired = f"{', '.join(f'{f} → {c}' for f, c in pairs[:5])}{', …' if len(pairs) > 5 else ''}"
        console.print(f"[yellow]![/yellow] the class names are not the folder names: paired with the folders in "
                      f"sorted order: {escape(paired)} (all in the result JSON, folder_classes)", highlight=False,
                      soft_wrap=True)
    counted = f"{samples} images" + (f", {texts} captions" if texts is not None else "")
    console.print(_result_table(escape(f"{kind} {record['dataset']}: {record['model']} ({counted})"), record))
    if output is not None:
        try:
            output.write_text(json.dumps(record) + "\n")
        except OSError as exc:
            _stop(f"cannot write {output}: {exc.strerror or exc}")
        console.print(f"[green]✓[/green] {escape(str(output))}", highlight=False, soft_wrap=True)


def _check_destination(path: Path) -> None:
    """A file written at the end of a long command, tried now: its folder made and the file opened for appending
    (a file this made is removed again); one line and the user-error code when it cannot be written."""
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        _stop(f"cannot write {path}: {path.parent} is not a directory")
    except OSError as exc:
        _stop(f"cannot write {path}: {exc.strerror or exc}")
    try:
        with open(path, "a"):
            pass
        if not existed:
            path.unlink()
    except OSError as exc:
        _stop(f"cannot write {path}: {exc.strerror or exc}")


def _result_table(title: str, record: dict) -> Table:
    """A result's scores: one row (classification), or recall@k a row per direction (retrieval)."""
    from fsdpclip.eval.evaluate import RECALL_K, recalls_by_direction

    table, metrics = Table(title=title), record["metrics"]
    if record["task"] != "zeroshot_retrieval":
        for key in metrics:
            table.add_column(key, justify="right")
        table.add_row(*(f"{v:.4f}" for v in metrics.values()))
        return table
    table.add_column("")
    for k in RECALL_K:
        table.add_column(f"recall@{k}", justify="right")
    for direction, values in recalls_by_direction(metrics).items():
        table.add_row(direction, *(f"{v:.4f}" for v in values))
    return table


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory (finished, running or stopped)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Where to draw the curves (default: RUN_DIR/report.png)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Summarise a run and draw its curves (loss, lr, logit scale, speed, MFU, data wait, zero-shot)."""
    from fsdpclip.cli.report import ReportError, plot, read_run, summary
    from fsdpclip.cli.tables import report_lines

    try:
        run = read_run(run_dir)
        info = summary(run)
        out = png or run_dir / "report.png"
        info["panels"], info["png"] = plot(run, out), str(out)
    except ReportError as exc:
        _stop(str(exc))
    except ImportError:
        _stop("fsdpclip report draws with matplotlib: pip install 'fsdpclip[report]'")
    except OSError as exc:
        _stop(f"cannot write the plot: {exc.strerror or exc}")
    if as_json:
        print(json.dumps(info, indent=2))
        return
    for line in report_lines(info):
        console.print(line, highlight=False, soft_wrap=True)


@app.command()
def models(
    pretrained: bool = typer.Option(False, "--pretrained", help="Only architectures with published weights, and "
                                                                "their tags (for model.pretrained)."),
    contains: Optional[str] = typer.Argument(None, help="Only names holding this text (any case), e.g. ViT-B."),
) -> None:
    """The OpenCLIP architectures model.name takes, and the tags of their published weights."""
    import open_clip

    from fsdpclip.model.published import published_tags

    tags = published_tags()
    names = [n for n in open_clip.list_models() if (n in tags or not pretrained) and
             (contains is None or contains.lower() in n.lower())]
    table = Table(title=f"{len(names)} OpenCLIP architectures" + (" with published weights" if pretrained else ""))
    table.add_column("model.name")
    table.add_column("model.pretrained (published tags)", overflow="fold")
    for name in names:
        table.add_row(name, ", ".join(tags.get(name, [])))
    console.print(table)


@app.command()
def init(
    out: Path = typer.Argument(..., help="Where to write the job spec (JSON)."),
    model: str = typer.Option("ViT-B-32", "--model", help="OpenCLIP architecture (fsdpclip models)."),
    data: Optional[str] = typer.Option(None, "--data", help="Webdataset shards, e.g. '/data/cc3m/{00000..00331}.tar' "
                                                            "(default: synthetic batches)."),
    samples: Optional[int] = typer.Option(None, "--samples", min=1, help="Image-text pairs in the shards of --data."),
    pretrained: Optional[str] = typer.Option(None, "--pretrained", help="Fine-tune these published weights of the "
                                                                        "model (fsdpclip models --pretrained)."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, max=MAX_WORLD_SIZE,
                                       help="GPUs to train on (default: those this machine sees; 0: the CPU)."),
    per_gpu: Optional[int] = typer.Option(None, "--per-gpu", min=1, help="Batch per GPU (default 128; 8 on the CPU)."),
    force: bool = typer.Option(False, "--force", help="Overwrite OUT."),
) -> None:
    """Write a job spec that passes validate: a model, its data and this machine's GPUs, each value explained."""
    from fsdpclip.model.weights import usable_cores
    from fsdpclip.spec.jobfile import parse_job
    from fsdpclip.spec.starter import described_fields, starter_spec
    from fsdpclip.validate.checks import check_job

    if (data is None) != (samples is None):
        _stop("--data and --samples go together: the shards and how many pairs they hold (without them: synthetic)")
    if out.exists() and not force:
        _stop(f"{out} exists: give another path, or --force to overwrite it")
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    spec = starter_spec(model, gpus, usable_cores(), data, samples, pretrained, per_gpu)
    try:
        report = check_job(parse_job(spec))
    except SpecError as exc:
        _fail(exc.problems)
    if report.errors:
        _fail(report.problems)
    try:
        out.write_text(json.dumps(spec, indent=2) + "\n")
    except OSError as exc:
        _stop(f"cannot write {out}: {exc.strerror or exc}")
    table = Table(title=escape(str(out)), title_justify="left")
    for column in ("field", "value", "what it means"):
        table.add_column(column, overflow="fold")
    for field, value, description in described_fields(spec):
        table.add_row(field, escape(json.dumps(value)), escape(description))
    console.print(table)
    if report.warnings:
        _problem_table(report.warnings, console)
    console.print(f"[green]✓[/green] {escape(str(out))} is valid for {report.world_size} rank(s); next: fsdpclip "
                  f"validate {escape(str(out))}, then fsdpclip launch {escape(str(out))}", highlight=False,
                  soft_wrap=True)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the job spec."""
    from fsdpclip.spec.job import json_schema

    print(json.dumps(json_schema(), indent=2))


@data_app.command("digits")
def data_digits(
    out_dir: Path = typer.Argument(..., help="Where to write the shards and the held-out split."),
    shards: int = typer.Option(8, min=1, help="Number of training shards."),
    seed: int = typer.Option(0, help="Seed of the split and the captions."),
) -> None:
    """Write scikit-learn's digits as webdataset shards with captions, plus a zero-shot split."""
    from fsdpclip.data.digits import write_digits

    try:
        info = write_digits(out_dir, shards=shards, seed=seed)
    except RuntimeError as exc:
        _stop(str(exc))
    done = (f"{info['train_samples']} training pairs in {shards} shards ({info['train_urls']}), "
            f"{info['test_samples']} held-out images in {info['test_dir']}")
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)
