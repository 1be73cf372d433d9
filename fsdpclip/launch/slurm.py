"""The Slurm launcher backend (`fsdpclip launch --slurm`): a batch script that starts torchrun on every node of
its allocation, written into the run directory and handed to sbatch. Rendering is pure string building
(`sbatch_script`); `submit` runs sbatch.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

from pydantic import AfterValidator, Field, field_validator

from fsdpclip.jobspec.backend import LAUNCHER_BACKENDS, LaunchError, LauncherBackend
from fsdpclip.launch.launcher import TORCHRUN, TRAIN_MODULE
from fsdpclip.run.directory import EXIT_PREEMPTED, JOB_FILE, LAUNCH_TIME_ENV, LOG_DIR
from fsdpclip.run.lock import lock_holder
from fsdpclip.jobspec.section import OneLine, Section, environment_names, one_line

if TYPE_CHECKING:
    from rich.console import Console

    from fsdpclip.jobspec.job import Job

BATCH_SCRIPT = "launch.sbatch"
SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=.*)?", re.DOTALL)


def sbatch_option(value: str) -> str:
    """One `--option[=value]` token (several options are several items; the batch script quotes each)."""
    one_line(value)
    if not SBATCH_OPTION.fullmatch(value):
        raise ValueError("one sbatch option per item, written '--option' or '--option=value' (e.g. '--mem=0')")
    return value


SbatchOption = Annotated[str, AfterValidator(sbatch_option)]


class SlurmSpec(Section):
    partition: Optional[OneLine] = Field(default=None, description="sbatch --partition.")
    account: Optional[OneLine] = Field(default=None, description="sbatch --account.")
    qos: Optional[OneLine] = Field(default=None, description="sbatch --qos.")
    time: Optional[str] = Field(
        default=None, pattern=r"^(\d+-)?\d+(:\d{2}){0,2}$", description="sbatch --time, e.g. "
                                                                        "'2-00:00:00' or '04:00:00'.")
    cpus_per_task: Optional[int] = Field(default=None, gt=0, description="sbatch --cpus-per-task (one task per node).")
    requeue: bool = Field(default=True, description="Requeue the job after preemption or a time-limit signal.")
    signal_seconds: int = Field(default=120, gt=0, description="Send USR1 this many seconds before the time limit.")
    extra_sbatch: list[SbatchOption] = Field(
        default_factory=list, description="More '#SBATCH' options, one '--option' or '--option=value' per item, e.g. "
                                          "'--exclusive'.")
    setup: list[OneLine] = Field(default_factory=list,
                                 description="Shell lines run before srun, e.g. 'source .venv/bin/activate'.")
    env: dict[str, OneLine] = Field(default_factory=dict,
                                    description="Environment variables exported in the batch script.")

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        return environment_names(value)


class SubmitError(LaunchError):
    """sbatch refused a batch script (its message)."""


class SlurmBackend(LauncherBackend):
    """A batch script for sbatch: Slurm starts every node, and requeues the job after a preemption."""

    name = "slurm"
    help = "Submit a batch script with sbatch instead of running here."
    spec = SlurmSpec
    description = "Slurm batch options for `launch --slurm`."

    def check_flags(self) -> None:
        flags = self.flags
        if flags.node_rank is not None or flags.master_addr is not None:
            raise LaunchError("--slurm starts every node itself: --node-rank and --master-addr are for launches "
                              "without Slurm")
        if flags.include is not None or flags.exclude is not None:
            raise LaunchError("--slurm runs on the nodes Slurm allocates: --include and --exclude pick hosts of a "
                              "--hostfile")
        if not flags.dry_run and shutil.which("sbatch") is None:
            raise LaunchError("--slurm needs Slurm's sbatch on the PATH (use --dry-run to only print the batch "
                              "script)")

    def start(self, job: Job, console: Console) -> Optional[dict]:
        """Write RUN_DIR/job.json and RUN_DIR/launch.sbatch and submit it (or only print the script)."""
        from rich.markup import escape

        script = sbatch_script(job)
        if self.flags.dry_run:
            print(script, end="")
            return None
        holder = lock_holder(job.run_dir)
        if holder is not None:
            raise LaunchError(f"{job.run_dir} is in use by {holder}: wait for that job to end or stop it, or give "
                              "this one another run.name")
        logs, script_path = job.run_dir / LOG_DIR, job.run_dir / BATCH_SCRIPT
        try:
            logs.mkdir(parents=True, exist_ok=True)
            job.save(job.run_dir / JOB_FILE)
            script_path.write_text(script)
        except OSError as exc:
            raise LaunchError(f"cannot use the run directory {job.run_dir}: {exc.strerror or exc}") from None
        try:
            job_id = submit(script_path)
        except SubmitError as exc:
            raise LaunchError(f"sbatch refused {script_path}: {exc}") from None
        console.print(f"[green]✓[/green] submitted batch job {escape(job_id)} ({job.launch.nodes} node(s) × "
                      f"{job.launch.gpus_per_node} rank(s)): {escape(str(script_path))}", highlight=False,
                      soft_wrap=True)
        console.print(escape(f"logs: {logs}/slurm-{job_id}.out and .err (the batch script), "
                             f"{logs}/slurm-{job_id}-node<N>.out (node N's ranks)"), highlight=False, soft_wrap=True)
        return None


def script_word(value: str) -> str:
    """A value as one word of the batch script, quoted for the shell (and for Slurm, which reads #SBATCH lines
    as the shell splits them). Every value rendered into the script passes here: one with a control character
    (a newline would start a line of its own, ending the #SBATCH options or running as a command) is refused,
    whatever let it into the spec."""
    return shlex.quote(script_line(value))


def script_line(line: str) -> str:
    """A line of the batch script as it is (a setup line): one line, no control character (`script_word`)."""
    try:
        return one_line(line)
    except ValueError as exc:
        raise LaunchError(f"cannot write {line!r} into the batch script: {exc}") from None


def slurm_block(job: Job) -> SlurmSpec:
    """The job's `launch.slurm`: the block this backend adds to the launch section when it registers."""
    block = getattr(job.launch, SlurmBackend.name)
    assert isinstance(block, SlurmSpec)
    return block


def sbatch_options(job: Job) -> list[str]:
    """The `#SBATCH` options of a job: its launch and slurm blocks, the logs in RUN_DIR/logs/."""
    launch, slurm = job.launch, slurm_block(job)
    logs = job.run_dir / LOG_DIR
    options = [f"--job-name={job.run.name}", f"--nodes={launch.nodes}", "--ntasks-per-node=1"]
    if slurm.cpus_per_task is not None:
        options.append(f"--cpus-per-task={slurm.cpus_per_task}")
    if launch.device == "cuda":
        options.append(f"--gres=gpu:{launch.gpus_per_node}")
    options += [f"--{name}={getattr(slurm, name)}" for name in ("partition", "account", "qos", "time")
                if getattr(slurm, name) is not None]
    if slurm.requeue:
        options += ["--requeue", f"--signal=B:USR1@{slurm.signal_seconds}"]
    options += ["--open-mode=append", f"--output={logs}/slurm-%j.out", f"--error={logs}/slurm-%j.err"]
    return [script_word(option) for option in [*options, *slurm.extra_sbatch]]


# The batch script after its options, exports and setup lines; {{name}} is filled in. The exit code
# comes from exit.json (completed from crash reports when the trainer could not write it), as for
# launches without Slurm.
SBATCH_BODY = r"""run_dir={{run_dir}}
# The rendezvous is on the first node of the allocation, at the address Slurm reaches it by.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
head_addr=$(sinfo -h -N -n "$head_node" -o %o | head -n 1)
export {{launch_time}}=$(date +%s.%N)
echo "fsdpclip: job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST, rendezvous at $head_addr:{{port}}"
{{trap}}
# One task per node: torchrun, which starts the node's ranks. Each node logs to its own file.
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1{{cpus}} \
    --open-mode=append --output={{node_log}} \
    {{python}} -m {{torchrun}} --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={{nproc}} \
    --rdzv-backend=c10d --rdzv-endpoint="$head_addr:{{port}}" --rdzv-id="$SLURM_JOB_ID" \
    -m {{train_module}} {{job_file}} &
step=$!
wait "$step"; status=$?
while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done  # a trapped signal ends `wait` early

# torchrun reports any failure as 1: use the code the trainer's rank 0 wrote to exit.json in this run
# (or, if a rank crashed before it could, the report made from the crash).
code=$({{python}} -m fsdpclip.run.reports "$run_dir" "${{launch_time}}" "$status" 2>/dev/null)
{{requeue}}
exit "${code:-$status}"
"""  # noqa: E501 (the script's echo line)

SBATCH_TRAP = r"""
# Preemption or the time limit: Slurm sends USR1 to this script only (--signal=B:USR1@S). It becomes
# a stop request in the run directory, which rank 0 reads at each stop check (at most 10 steps or about
# 10 s apart): the ranks finish their step, checkpoint and exit 75. No signal reaches torchrun (it would
# kill its ranks 30 s later) or the data workers.
preempted=
trap 'preempted=1; echo "fsdpclip: USR1: asking the trainer to checkpoint and stop"; touch "$run_dir/stop"' USR1
"""

SBATCH_REQUEUE = rf"""
if [ -n "$preempted" ] && [ "$code" = {EXIT_PREEMPTED} ]; then
    echo "fsdpclip: checkpoint saved; requeueing job $SLURM_JOB_ID (it resumes from checkpoints/latest)"
    scontrol requeue "$SLURM_JOB_ID"
fi
"""


def sbatch_script(job: Job, python: Optional[str] = None) -> str:
    """The batch script of `launch --slurm` for a job with resolved paths.

    One srun task per node runs torchrun, which meets the other nodes at a c10d rendezvous on
    the first node and starts the trainer on RUN_DIR/job.json. With requeue on, Slurm's USR1
    becomes a stop request (RUN_DIR/stop), the ranks checkpoint and exit 75, and the script requeues
    the job, which resumes from checkpoints/latest. `python` defaults to this interpreter, or to
    `python` on the PATH when the spec's setup lines choose the environment.
    """
    launch, slurm = job.launch, slurm_block(job)
    environment = {"PYTHONUNBUFFERED": "1", **launch.env, **slurm.env}
    if slurm.requeue:  # torchrun's grace for its workers after SIGTERM: what Slurm leaves before the limit
        environment["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(slurm.signal_seconds)
    head = [
        ["#!/bin/bash",
         script_line(f"# fsdpclip job {job.run.name}: {launch.nodes} node(s) x {launch.gpus_per_node} rank(s) "
                     f"({launch.device}),"),
         "# rendered by `fsdpclip launch --slurm` (see cluster/README.md).",
         *(f"#SBATCH {option}" for option in sbatch_options(job))],
        [f"export {script_line(key)}={script_word(value)}" for key, value in environment.items()],
        [script_line(line) for line in slurm.setup],
    ]
    values = {
        "run_dir": script_word(str(job.run_dir)),
        "launch_time": LAUNCH_TIME_ENV,
        "port": str(launch.master_port),
        "trap": SBATCH_TRAP if slurm.requeue else "",
        "cpus": f" --cpus-per-task={slurm.cpus_per_task}" if slurm.cpus_per_task is not None else "",
        "node_log": script_word(str(job.run_dir / LOG_DIR / "slurm-%j-node%n.out")),
        "python": script_word(python or ("python" if slurm.setup else sys.executable)),
        "nproc": str(launch.gpus_per_node),
        "train_module": TRAIN_MODULE,
        "torchrun": TORCHRUN,
        "job_file": script_word(str(job.run_dir / JOB_FILE)),
        "requeue": SBATCH_REQUEUE if slurm.requeue else "",
    }
    body = re.sub(r"\{\{(\w+)\}\}", lambda match: values[match.group(1)], SBATCH_BODY)
    return "\n\n".join("\n".join(block) for block in head if block) + "\n\n" + body


def submit(script: Path) -> str:
    """Submit a batch script with sbatch (in this environment); return the job id."""
    process = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if process.returncode != 0:
        raise SubmitError(process.stderr.strip() or f"sbatch exited with code {process.returncode}")
    return process.stdout.strip().split(";")[0]


LAUNCHER_BACKENDS.register(SlurmBackend)
