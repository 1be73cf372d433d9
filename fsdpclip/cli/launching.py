"""`fsdpclip launch` and `fsdpclip fetch`: a job validated, checked on this node and started by the launcher
backend its flag picks (`fsdpclip.jobspec.backend.LAUNCHER_BACKENDS`), and published weights fetched before it."""

from __future__ import annotations

import inspect
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer
from rich.markup import escape

from fsdpclip.cli.console import (
    WithRegisteredOptions, console, err_console, fail, model_error_line, option, problem_table, stop,
)
from fsdpclip.jobspec.problems import MAX_WORLD_SIZE, ModelError, Problem, SpecError

if TYPE_CHECKING:
    from fsdpclip.jobspec.backend import LaunchFlags
    from fsdpclip.jobspec.job import Job, ModelSpec

ACCEPT_CHANGES_HELP = ("Resume even where the relaunch changes the run's global batch, length or LR at the resume "
                       "step (checkpoint.accept_changes); each is printed first.")


def accepted(accept_changes: bool) -> list[str]:
    """The override `--accept-changes` stands for."""
    return ["checkpoint.accept_changes=true"] if accept_changes else []


def launch_command(
    job_file: Path = typer.Argument(..., help="The job spec (JSON)."),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", "--nproc-per-node", min=1, max=MAX_WORLD_SIZE,
                                                help="Processes per node (default: launch.gpus_per_node)."),
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, max=MAX_WORLD_SIZE,
                                        help="Number of nodes (default: launch.nodes)."),
    partition: Optional[str] = typer.Option(None, "--partition", help="Slurm partition (default: launch.slurm)."),
    time_limit: Optional[str] = typer.Option(None, "--time", help="Slurm time limit (default: launch.slurm)."),
    node_rank: Optional[int] = typer.Option(None, "--node-rank", min=0,
                                            help="Without Slurm: this node's rank, 0 to --nodes - 1."),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="Without Slurm: the address of node 0."),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535,
                                              help="Rendezvous port on node 0 (default: launch.master_port)."),
    include: Optional[str] = typer.Option(None, "--include", metavar="HOST[:SLOTS][@HOST...]",
                                          help="With --hostfile: only these hosts (and slots), e.g. a@b:0,1."),
    exclude: Optional[str] = typer.Option(None, "--exclude", metavar="HOST[:SLOTS][@HOST...]",
                                          help="With --hostfile: all hosts (and slots) but these."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only print what would run (or the batch script)."),
    check_paths: bool = typer.Option(True, "--check-paths/--no-check-paths",
                                     help="Check that data, eval and weight files exist (off for cluster paths)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a field: --set batch.per_gpu=64."),
    accept_changes: bool = typer.Option(False, "--accept-changes", help=ACCEPT_CHANGES_HELP),
    **backend_flags,
) -> None:
    """Validate a job and run it with torchrun on this node, submit it to Slurm (--slurm), or run it on every host
    of a hostfile over ssh (--hostfile)."""
    from fsdpclip.jobspec.backend import DEFAULT_BACKEND, LAUNCHER_BACKENDS, LaunchError, LaunchFlags
    from fsdpclip.launch.launcher import resolve_paths
    from fsdpclip.jobspec.jobfile import load_job

    picked = {name: value for name, value in backend_flags.items() if value not in (None, False)}
    if len(picked) > 1:
        stop(f"give one of {', '.join('--' + name for name in picked)}, not several")
    name, value = next(iter(picked.items()), (DEFAULT_BACKEND, None))
    flags = LaunchFlags(nodes, gpus_per_node, name, partition, time_limit, node_rank, master_addr, master_port, dry_run,
                        None if isinstance(value, bool) else value, include, exclude)
    backend = LAUNCHER_BACKENDS[flags.backend](flags)
    here = backend.runs_here and not dry_run
    try:
        flags.check()
        backend.check_flags()
        job = load_job(job_file, [*overrides, *flags.overrides(), *backend.overrides(), *accepted(accept_changes)])
        backend.prepare(job)  # before the checks import torch
        from fsdpclip.launch.local import in_a_fork
        from fsdpclip.validate.checks import check_job, kept_on_resume

        job = kept_on_resume(job)

        def checks() -> list[Problem]:
            return check_job(job, check_paths=check_paths, on_this_node=here).problems

        problems = [*(in_a_fork(checks) if backend.forks_ranks() else checks()), *_node_problems(job, flags, here)]
        if any(problem.severity == "error" for problem in problems):
            fail(problems)
        if problems:
            problem_table(problems, console)
        backend.check_job(job)
    except SpecError as exc:
        from fsdpclip.validate.checks import spec_error_problems

        fail(spec_error_problems(exc, check_paths=check_paths, on_this_node=here) +
             _node_problems(exc.salvaged, flags, here))
    except LaunchError as exc:
        stop(str(exc))
    job = resolve_paths(job, Path.cwd())
    if here:
        _end_if_finished(job, flags)
    if not dry_run:
        _fetch_published(job.model)
    try:
        ended = backend.start(job, console)
    except LaunchError as exc:
        stop(str(exc))
    if ended is not None:
        _ending(ended["code"], ended["message"], job)


def backend_options() -> list[inspect.Parameter]:
    """A flag per launcher backend but the default: `--NAME`, or `--NAME VALUE` for one with a metavar."""
    from fsdpclip.jobspec.backend import DEFAULT_BACKEND, LAUNCHER_BACKENDS

    return [option(name.replace("-", "_"), bool, typer.Option(False, f"--{name}", help=backend.help))
            if backend.metavar is None else
            option(name.replace("-", "_"), Optional[str],
                   typer.Option(None, f"--{name}", metavar=backend.metavar, help=backend.help))
            for name, backend in LAUNCHER_BACKENDS.members().items() if name != DEFAULT_BACKEND]


launch = WithRegisteredOptions(launch_command, backend_options, after="nodes")


def _node_problems(job: Optional[Job], flags: LaunchFlags, here: bool) -> list[Problem]:
    """This node's rows where the ranks start `here`, to stand beside the spec's: none elsewhere, nor where the
    launch section did not parse."""
    from fsdpclip.validate.checks import if_parsed

    if not here or job is None:
        return []
    return if_parsed(_preflight, job, flags) or []


def _preflight(job: Job, flags: LaunchFlags) -> list[Problem]:
    """This node's problems with starting the job's ranks (`validate.preflight`: its GPUs, the rendezvous port)."""
    from fsdpclip.validate.preflight import preflight

    static_rendezvous = job.launch.nodes > 1 or flags.master_addr is not None
    return preflight(job, flags.node_rank or 0, static_rendezvous).problems


def _end_if_finished(job: Job, flags: LaunchFlags) -> None:
    """A run already over ends the launch on node 0 as finished, starting nothing."""
    from fsdpclip.run.directory import EXIT_OK
    from fsdpclip.validate.preflight import already_finished

    finished = already_finished(job) if (flags.node_rank or 0) == 0 else None
    if finished:
        _ending(EXIT_OK, finished, job)


def _ending(code: int, message: str, job: Job) -> None:
    """How a launch ended, its run directory and the commands that come next, each of which runs as printed; exits
    with `code`."""
    from fsdpclip.checkpoint.layout import latest_checkpoint
    from fsdpclip.run.directory import EXIT_OK, EXIT_PREEMPTED, EXIT_STOPPED_AT_ONCE, LOG_DIR

    stopped = code in (EXIT_PREEMPTED, EXIT_STOPPED_AT_ONCE)
    mark = "[green]✓[/green]" if code == EXIT_OK else "[yellow]‖[/yellow]" if stopped else "[red]✗[/red]"
    run_dir, relaunch = job.run_dir, shlex.join(["fsdpclip", *sys.argv[1:]])
    report = f"fsdpclip report {shlex.quote(str(run_dir))}"
    if code == EXIT_OK:
        follow = [f"next: {report}", *(f"      {command}" for command in _next_commands(job))]
    elif stopped and latest_checkpoint(run_dir) is not None:
        follow = [f"resume: {relaunch}", f"progress: {report}"]
    else:
        logs = [f"logs: {run_dir / LOG_DIR}"] if (run_dir / LOG_DIR).is_dir() else []
        follow = [*logs, f"run again (it resumes from the last checkpoint, if any): {relaunch}", f"progress: {report}"]
    out = console if code == EXIT_OK else err_console
    for line in [f"{mark} {escape(message)}", f"run directory: {escape(str(run_dir))}", *map(escape, follow)]:
        out.print(line, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _next_commands(job: Job) -> list[str]:
    """After a finished run: its first evaluation set evaluated again (where it has one) and its export."""
    from fsdpclip.jobspec.task import task_of

    run_dir = str(job.run_dir)
    evaluate = [shlex.join(["fsdpclip", "eval", run_dir, *task_of(spec).flags(spec)]) for spec in job.eval.sets[:1]]
    return [*evaluate, shlex.join(["fsdpclip", "export", run_dir, f"{job.run.name}.safetensors"])]


def _fetch_published(model: ModelSpec) -> None:
    """Published weights into the Hugging Face cache of this node, once, before any rank starts."""
    from fsdpclip.model.published import fetch

    if model.published_tag is None:
        return
    try:
        with console.status(f"fetching the '{model.published_tag}' weights of {model.name}"):
            assert model.name is not None  # published weights are a named model's (validated)
            file, downloaded = fetch(model.name, model.published_tag)
    except ModelError as exc:
        stop(f"{exc.location}: {model_error_line(exc)}")
    if downloaded:
        console.print(f"[green]✓[/green] fetched the '{model.published_tag}' weights of {model.name}: {escape(file)}",
                      highlight=False, soft_wrap=True)


def fetch(
    name: str = typer.Argument(..., help="OpenCLIP architecture, e.g. ViT-B-32."),
    tag: str = typer.Argument(
        ..., help="Its published weights, e.g. laion2b_s34b_b79k (fsdpclip models --pretrained)."),
) -> None:
    """Download OpenCLIP's published weights into the Hugging Face cache (HF_HOME), for model.pretrained."""
    from fsdpclip.model.published import fetch as fetch_weights

    try:
        with console.status(f"fetching the '{tag}' weights of {name}"):
            file, downloaded = fetch_weights(name, tag)
    except ModelError as exc:
        stop(model_error_line(exc))
    console.print(f"[green]✓[/green] {'fetched' if downloaded else 'already cached'}: {escape(file)}", highlight=False,
                  soft_wrap=True)
