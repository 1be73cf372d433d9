"""The `fsdpclip` command line: parse arguments, call the library, render with rich. The commands of launching
(`cli.launching`) and of checkpoints (`cli.evaluating`) are in modules of their own, registered here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from fsdpclip.cli import evaluating, launching
from fsdpclip.cli.console import check_destination, console, err_console, fail, problem_table, stop
from fsdpclip.jobspec.problems import MAX_WORLD_SIZE, Problem, SpecError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Train OpenCLIP models with PyTorch FSDP2 from one JSON job spec.")
data_app = typer.Typer(no_args_is_help=True, help="Build datasets.")
app.add_typer(data_app, name="data", help="Build datasets: webdataset shards from your own images, "
                                          "shards resized, the offline digits demo.")


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        from fsdpclip import __version__

        console.print(f"fsdpclip {__version__} (open_clip_torch {version('open_clip_torch')}, "
                      f"torch {version('torch')})", highlight=False)
        raise typer.Exit()


@app.callback()
def _options(_: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                    help="Print the versions of fsdpclip, OpenCLIP and torch, and exit.")) -> None:
    pass


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
    check_remote: bool = typer.Option(False, "--check-remote",
                                      help="Reach checkpoint.remote (list it, write and delete an object there) and "
                                           "a resume URL's checkpoint: credentials and reachability."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
    accept_changes: bool = typer.Option(False, "--accept-changes", help=launching.ACCEPT_CHANGES_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
) -> None:
    """Check a job spec and its meaning before any GPU is allocated."""
    from fsdpclip.cli.tables import summary_tables
    from fsdpclip.jobspec.jobfile import load_job
    from fsdpclip.validate.checks import check_job, kept_on_resume, layout_of, spec_error_problems

    if world_size is not None and (nodes is not None or gpus_per_node is not None):
        fail([Problem("--world-size", "give --world-size or --nodes/--gpus-per-node, not both")], as_json)
    try:
        job = load_job(job_file, [*overrides, *launching.accepted(accept_changes)])
    except SpecError as exc:
        fail(spec_error_problems(exc, world_size, nodes, gpus_per_node, check_paths=check_paths,
                                 check_remote=check_remote), as_json)
    if check_paths:
        job = kept_on_resume(job)
    report = check_job(job, *layout_of(job, world_size, nodes, gpus_per_node), check_paths=check_paths,
                       check_remote=check_remote)
    if report.errors:
        fail(report.problems, as_json)
    if as_json:
        print(json.dumps({"ok": True, "errors": [], "warnings": [p.as_dict() for p in report.warnings],
                          "summary": report.summary}, indent=2))
        return
    if report.warnings:
        problem_table(report.warnings, console)
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
                                           help="Sustained TFLOP/s per GPU (default: what fsdpclip measured on "
                                                "H200; needed for a job on the CPU)."),
    gpu_memory_gib: Optional[float] = typer.Option(None, "--gpu-memory-gib", min=1e-3,
                                                   help="Memory of one GPU (default: launch.gpu_memory_gib, else "
                                                        "an H200's 139)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Compare the ways to lay a job over NODES x GPUS: replication, HSDP at each shard degree, full FSDP."""
    from dataclasses import asdict

    from fsdpclip.cli.tables import plan_model_line, plan_table
    from fsdpclip.plan.mesh import GPU_MEMORY_GIB, INTER_GBPS, INTRA_GBPS
    from fsdpclip.plan.resolved import plan_job
    from fsdpclip.jobspec.jobfile import load_job
    from fsdpclip.validate.checks import check_job

    try:
        job = load_job(job_file, overrides)
    except SpecError as exc:
        fail(exc.problems, as_json)
    if job.batch.searched:
        fail([Problem("batch.per_gpu", "'auto' is settled at start on the GPU; plan prices a given batch", "auto",
                      hint="--set batch.per_gpu=N (validate shows the estimate the search starts from)")], as_json)
    world = nodes * gpus_per_node
    job = job.model_copy(update={"batch": job.batch.model_copy(update={"global_batch": None})})  # per GPU counts
    report = check_job(job, world, gpus_per_node, check_paths=False)
    # plan prices the model: the degree is what it helps choose, and the data does not enter its numbers
    blocking = [p for p in report.errors if p.location != "fsdp.shard_degree" and not p.location.startswith("data")]
    if job.launch.device == "cpu" and tflops is None:
        blocking.append(Problem("launch.device", "plan prices GPUs, at the rate fsdpclip sustained on H200: a step of "
                                                 "ranks on the CPU is mostly host work its model leaves out", "cpu",
                                hint="--tflops N prices each rank at N TFLOP/s"))
    if blocking:
        fail(blocking, as_json)
    capacity = gpu_memory_gib or job.launch.gpu_memory_gib or GPU_MEMORY_GIB
    intra_gbps, inter_gbps = intra_gbps or INTRA_GBPS, inter_gbps or INTER_GBPS
    result = plan_job(job, nodes, gpus_per_node, capacity, tflops, intra_gbps, inter_gbps)
    if as_json:
        print(json.dumps(asdict(result) | {"spec_shard_degree": job.fsdp.shard_degree}, indent=2))
        return
    console.print(plan_table(job, result, capacity))
    console.print(plan_model_line(result, intra_gbps, inter_gbps), highlight=False, soft_wrap=True)


app.command("launch")(launching.launch)
app.command()(launching.fetch)


@app.command()
def train(job_file: Path = typer.Argument(..., help="The resolved spec, usually RUN_DIR/job.json.")) -> None:
    """Train on this rank (what torchrun starts on every rank; `fsdpclip launch` starts it for you and keeps a
    resumed run's global batch on other world sizes)."""
    from fsdpclip.launch.entry import main

    raise typer.Exit(main([str(job_file)]))


app.command()(evaluating.export)
app.command("import")(evaluating.import_command)
app.command("eval")(evaluating.evaluate)


@app.command()
def report(
    run_dir: Path = typer.Argument(..., help="A run directory (finished, running or stopped)."),
    png: Optional[Path] = typer.Option(None, "--png", help="Where to draw the curves (default: RUN_DIR/report.png)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
) -> None:
    """Summarise a run and draw its curves (loss, lr, logit scale, speed, MFU, data wait, zero-shot)."""
    from fsdpclip.cli.report import ReportError, plot, read_run, summary
    from fsdpclip.cli.tables import report_lines

    if png is not None and png.suffix.lower() != ".png":
        stop(f"--png {png}: the curves are drawn as a PNG: give a path ending in .png")
    out = png or run_dir / "report.png"
    unwritten = None
    try:
        run = read_run(run_dir)
    except ReportError as exc:
        stop(str(exc))
    except OSError as exc:
        stop(f"cannot read {run_dir}: {exc.strerror or exc}")
    info = summary(run)
    try:
        info["panels"], info["png"] = plot(run, out), str(out)
    except ImportError:
        stop("fsdpclip report draws with matplotlib: pip install 'fsdpclip[report]'")
    except (ReportError, OSError) as exc:  # nothing logged yet, a read-only run directory: the summary still stands
        unwritten = str(exc) if isinstance(exc, ReportError) else f"cannot write the plot {out}: {exc.strerror or exc}"
        info["panels"], info["png"] = [], None
    if as_json:
        print(json.dumps(info, indent=2))
    else:
        for line in report_lines(info):
            console.print(line, highlight=False, soft_wrap=True)
    if unwritten:
        err_console.print(f"[yellow]![/yellow] {escape(unwritten)}", highlight=False, soft_wrap=True)


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
    from fsdpclip.jobspec.jobfile import parse_job
    from fsdpclip.jobspec.starter import described_fields, starter_spec
    from fsdpclip.validate.checks import check_job

    if (data is None) != (samples is None):
        stop("--data and --samples go together: the shards and how many pairs they hold (without them: synthetic)")
    check_destination(out, overwrite=force)
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    spec = starter_spec(model, gpus, data, samples, pretrained, per_gpu)
    try:
        report = check_job(parse_job(spec))
    except SpecError as exc:
        fail(exc.problems)
    if report.errors:
        fail(report.problems)
    try:
        out.write_text(json.dumps(spec, indent=2) + "\n")
    except OSError as exc:
        stop(f"cannot write {out}: {exc.strerror or exc}")
    table = Table(title=escape(str(out)), title_justify="left")
    for column in ("field", "value", "what it means"):
        table.add_column(column, overflow="fold")
    for field, value, description, why in described_fields(spec):
        table.add_row(field, escape(json.dumps(value)), escape(description + (f" ({why})" if why else "")))
    console.print(table)
    if report.warnings:
        problem_table(report.warnings, console)
    console.print(f"[green]✓[/green] {escape(str(out))} is valid for {report.world_size} rank(s); next: fsdpclip "
                  f"validate {escape(str(out))}, then fsdpclip launch {escape(str(out))}", highlight=False,
                  soft_wrap=True)


@app.command("env")
def environment(
    run_root: Path = typer.Option(Path("runs"), "--run-root", help="Where run directories go (run.output_dir): "
                                                                   "checked for writing."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
) -> None:
    """Report this node for a bug report: versions, GPUs, InfiniBand, Slurm, cores, memory, the run root."""
    from fsdpclip.cli.tables import environment_table
    from fsdpclip.validate.environment import environment as collect

    found = collect(run_root)
    if as_json:
        print(json.dumps(found, indent=2))
        return
    console.print(environment_table(found))
    if found["gpu_topology"]:
        console.print(escape(found["gpu_topology"]), highlight=False)


@app.command()
def schema() -> None:
    """Print the JSON Schema of the job spec."""
    from fsdpclip.jobspec.job import json_schema

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
        stop(str(exc))
    done = (f"{info['train_samples']} training pairs in {shards} shards ({info['train_urls']}), "
            f"{info['test_samples']} held-out images in {info['test_dir']}")
    console.print(f"[green]✓[/green] {escape(done)}", highlight=False, soft_wrap=True)


def _short_side(size: Optional[int], model: Optional[str], job_file: Optional[Path]) -> int:
    """The short side images are shrunk to: --size, or the image size of --model's or --job's model × 1.15."""
    from fsdpclip.data.writer import MARGIN, short_side_for

    if sum(given is not None for given in (size, model, job_file)) != 1:
        stop(f"give one of --size N (the short side, in pixels), --model NAME or --job FILE (the model's image size "
             f"× {MARGIN})")
    if size is not None:
        return size
    from fsdpclip.cli.console import model_error_line
    from fsdpclip.model.build import model_config
    from fsdpclip.jobspec.problems import ModelError
    from fsdpclip.jobspec.job import ModelSpec
    from fsdpclip.jobspec.jobfile import load_job

    try:
        job = load_job(job_file) if job_file is not None else None
        config = model_config(job.model if job else ModelSpec(name=model))
    except SpecError as exc:
        fail(exc.problems)
    except ModelError as exc:
        stop(model_error_line(exc))
    image_size = config["vision_cfg"].get("image_size")
    if image_size is None:
        stop(f"the image size of {model or job_file}'s model is not in its config: give --size N")
    return short_side_for(image_size)


def _written(written, out: Path, what: str) -> None:
    """What a run of `data shards` or `data resize` left: its samples, what it skipped, the data block."""
    resumed = f", {written.resumed} of them from an earlier run" if written.resumed else ""
    shards = f"{written.shards:,} shard{'s' * (written.shards != 1)}"
    console.print(f"[green]✓[/green] {written.samples:,} samples in {shards} in {escape(str(out))}{resumed}",
                  highlight=False, soft_wrap=True)
    if written.skipped:
        console.print(f"[yellow]![/yellow] {written.skipped:,} image{'s' * (written.skipped != 1)} {what}; "
                      + escape("; ".join(written.reasons)), highlight=False, soft_wrap=True)
    console.print(f"the job spec's data block (also in {escape(str(out / 'shards.json'))}):", highlight=False)
    print(json.dumps({"data": written.spec()}, indent=2))


def _with_progress(total: int, unit: str, write) -> object:
    """`write(advance)` under a rich progress bar of `total` `unit`; Ctrl-C or SIGTERM: one line, exit 130."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from fsdpclip.data.writer import WriteError

    try:
        with Progress(TextColumn(unit), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=console, transient=True, disable=not console.is_terminal) as progress:
            task = progress.add_task(unit, total=total)
            return write(lambda count: progress.advance(task, count))
    except WriteError as exc:
        stop(str(exc))
    except KeyboardInterrupt:
        err_console.print("[red]✗[/red] interrupted: the shards written whole are kept; the same command goes on "
                          "from them", highlight=False)
        raise typer.Exit(130) from None


SIZE_HELP = "Short side to shrink images to, in pixels (or --model / --job)."
MODEL_HELP = "Shrink to this OpenCLIP model's image size × 1.15 (ViT-B-32: 258)."
JOB_HELP = "Shrink to the image size × 1.15 of this job spec's model."
QUALITY_HELP = "JPEG quality of the images re-encoded."
WORKERS_HELP = "Processes (default: this node's cores)."


@data_app.command("shards")
def data_shards(
    source: Path = typer.Argument(..., help="A caption table (.csv, .tsv or .parquet: an image path and a caption "
                                            "per row) or a folder of images with captions beside them "
                                            "(name.jpg and name.txt)."),
    out: Path = typer.Argument(..., help="Where to write the shards (a new or empty folder, or the one an "
                                         "interrupted run wrote)."),
    size: Optional[int] = typer.Option(None, "--size", min=8, help=SIZE_HELP),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    job_file: Optional[Path] = typer.Option(None, "--job", help=JOB_HELP),
    quality: int = typer.Option(90, "--quality", min=1, max=100, help=QUALITY_HELP),
    shard_size: int = typer.Option(10_000, "--shard-size", min=1, help="Rows of the source per shard."),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help=WORKERS_HELP),
    image_key: str = typer.Option("filepath", "--csv-img-key", help="The table's column of image paths "
                                                                    "(open_clip_train's --csv-img-key)."),
    caption_key: str = typer.Option("title", "--csv-caption-key", help="The table's column of captions "
                                                                       "(open_clip_train's --csv-caption-key)."),
    separator: Optional[str] = typer.Option(None, "--csv-separator", help="The table's separator (default: a tab "
                                                                          "if its header line holds one, else a "
                                                                          "comma)."),
    image_root: Optional[Path] = typer.Option(None, "--image-root", help="Where the table's relative image paths "
                                                                         "start (default: the table's folder; "
                                                                         "open_clip_train's: the current one, "
                                                                         "--image-root .)."),
) -> None:
    """Write webdataset shards (jpg, txt) from your own images, shrunk, in parallel; resumable, skipping
    unreadable images."""
    from fsdpclip.data.writer import WriteError, folder_pairs, table_pairs, write_shards
    from fsdpclip.run.node import usable_cores

    short_side = _short_side(size, model, job_file)
    if not source.exists():
        stop(f"{source} does not exist: give a caption table or a folder of images")
    try:
        pairs = folder_pairs(source) if source.is_dir() else table_pairs(source, image_key, caption_key,
                                                                         separator, image_root)
    except WriteError as exc:
        stop(str(exc))
    written = _with_progress(len(pairs), "images", lambda advance: write_shards(
        pairs, out, short_side, quality, shard_size, workers or usable_cores(), str(source.resolve()), advance))
    _written(written, out, "skipped (unreadable, or without a caption)")


@data_app.command("resize")
def data_resize(
    shards: str = typer.Argument(..., help="Webdataset shards: a folder of .tar files, or a path or URL with brace "
                                           "expansion as data.urls takes them."),
    out: Path = typer.Argument(..., help="Where to write the resized shards, under their own names."),
    size: Optional[int] = typer.Option(None, "--size", min=8, help=SIZE_HELP),
    model: Optional[str] = typer.Option(None, "--model", help=MODEL_HELP),
    job_file: Optional[Path] = typer.Option(None, "--job", help=JOB_HELP),
    quality: int = typer.Option(90, "--quality", min=1, max=100, help=QUALITY_HELP),
    workers: Optional[int] = typer.Option(None, "--workers", min=1, help=WORKERS_HELP),
    image_key: str = typer.Option("jpg;png;jpeg;webp", "--image-key",
                                  help="Members that are images, ';'-separated (as data.image_key)."),
) -> None:
    """Shrink the images of existing shards to a short side (other members copied); resumable."""
    from fsdpclip.jobspec.urls import is_local, local_path, shard_urls
    from fsdpclip.data.writer import resize_shards
    from fsdpclip.run.node import usable_cores

    short_side = _short_side(size, model, job_file)
    folder = Path(shards)
    urls = sorted(str(path) for path in folder.glob("*.tar")) if folder.is_dir() else shard_urls(shards)
    missing = [url for url in urls if is_local(url) and not Path(local_path(url)).is_file()]
    if missing:
        stop(f"{missing[0]} does not exist ({len(missing)} of the {len(urls)} shards are missing)")
    keys = tuple(key.strip().lower() for key in image_key.split(";") if key.strip())
    written = _with_progress(len(urls), "shards", lambda advance: resize_shards(
        urls, out, short_side, quality, keys, workers or usable_cores(), advance))
    _written(written, out, "unreadable, kept unchanged")
