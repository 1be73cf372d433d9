"""Render the commands that start a job and run or submit them.

Three ways to start a job: torchrun on this node (`torchrun_command`; with a static rendezvous
when the job spans nodes and you start each node yourself), or a Slurm batch script
(`sbatch_script`) that starts torchrun on every node of its allocation. Rendering is pure string
building; `run_local` takes the run directory and runs torchrun under `supervise` (signals to the
launcher become a checkpoint-and-stop request), and `submit` hands a batch script to sbatch.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from fsdpclip.data.urls import is_local
from fsdpclip.run.directory import (
    EXIT_PREEMPTED, JOB_FILE, LAUNCH_TIME_ENV, LAUNCHER_ENV, LOCK_TOKEN_ENV, LOG_DIR, HeldLock, RunLocked,
    finish_exit_report, keep_output, process_identity, request_stop,
)
from fsdpclip.spec.job import Job, one_line
from fsdpclip.spec.registry import DATA_SOURCES

TRAIN_MODULE = "fsdpclip.train.entry"
TORCHRUN = "fsdpclip.launch.torchrun"  # torchrun, without a traceback for the trainer's deliberate exits
STOPPED_AT_ONCE = 130  # the exit status of a launch stopped by a second Ctrl-C or SIGTERM
LAUNCHER_LOG = "launch.out"  # RUN_DIR/logs/: the launcher's and torchrun's output once their terminal is gone
BATCH_SCRIPT = "launch.sbatch"


class LaunchError(Exception):
    """A launch that cannot go ahead as asked (message meant for the user)."""


class SubmitError(LaunchError):
    """sbatch refused a batch script (its message)."""


@dataclass(frozen=True)
class LaunchFlags:
    """What `fsdpclip launch` was asked on its command line, beside the spec."""

    nodes: Optional[int] = None
    gpus_per_node: Optional[int] = None
    slurm: bool = False
    partition: Optional[str] = None
    time_limit: Optional[str] = None
    node_rank: Optional[int] = None
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    dry_run: bool = False

    def check(self) -> None:
        """Flag values and combinations that cannot work, before the spec is read."""
        for flag, value in (("--partition", self.partition), ("--time", self.time_limit)):
            try:
                one_line(value or "")
            except ValueError as exc:
                raise LaunchError(f"{flag} {value!r}: {exc}") from None
        if self.slurm and (self.node_rank is not None or self.master_addr is not None):
            raise LaunchError("--slurm starts every node itself: --node-rank and --master-addr are for launches "
                              "without Slurm")
        if not self.slurm and (self.partition is not None or self.time_limit is not None):
            raise LaunchError("--partition and --time are Slurm options: add --slurm")
        if self.node_rank is not None and self.master_addr is None:
            raise LaunchError("--node-rank needs --master-addr, the address of node 0")
        if self.slurm and not self.dry_run and shutil.which("sbatch") is None:
            raise LaunchError("--slurm needs Slurm's sbatch on the PATH (use --dry-run to only print the batch script)")

    def overrides(self) -> list[str]:
        """The flags that set spec fields, as `--set` assignments."""
        fields = {"launch.nodes": self.nodes, "launch.gpus_per_node": self.gpus_per_node,
                  "launch.master_port": self.master_port, "launch.slurm.partition": self.partition,
                  "launch.slurm.time": self.time_limit}
        return [f"{key}={json.dumps(value)}" for key, value in fields.items() if value is not None]

    def check_nodes(self, job: Job) -> None:
        """A launch on several nodes needs Slurm or one launch per node with its rank."""
        nodes = job.launch.nodes
        if not self.slurm and nodes > 1 and self.node_rank is None:
            raise LaunchError(f"{nodes} nodes without Slurm: run `fsdpclip launch` on each node with --node-rank R "
                              "and --master-addr (node 0's address), or add --slurm")
        if self.node_rank is not None and self.node_rank >= nodes:
            raise LaunchError(f"--node-rank {self.node_rank} is not below the number of nodes ({nodes})")

    def torchrun(self, job: Job, fork_ranks: bool = False) -> list[str]:
        """The torchrun command for this node (`fork_ranks`: see `torchrun_command`)."""
        return torchrun_command(job.run_dir / JOB_FILE, job.launch.gpus_per_node, job.launch.nodes,
                                self.node_rank or 0, self.master_addr, job.launch.master_port, fork_ranks=fork_ranks)


def resolve_paths(job: Job, base: Path) -> Job:
    """The job with every local path made absolute (relative ones are relative to `base`)."""

    def absolute(path: Optional[str]) -> Optional[str]:
        return None if path is None else str((base / path).resolve()) if is_local(path) else path

    def resolve_fields(block, names: tuple[str, ...]) -> None:  # a path, a list of them, or another value
        for name in names:
            value = getattr(block, name)
            setattr(block, name, absolute(value) if isinstance(value, str) else
                    [absolute(v) for v in value] if isinstance(value, list) else value)

    data = job.model_copy(deep=True)
    data.run.output_dir = absolute(job.run.output_dir)
    model = data.model
    model.config = absolute(model.config)
    model.pretrained = model.pretrained if model.published_tag else absolute(model.pretrained)
    model.image.pretrained, model.text.pretrained = absolute(model.image.pretrained), absolute(model.text.pretrained)
    for family, block in filter(None, (model.image.family, model.text.family)):
        resolve_fields(block, family.paths(block))
    resolve_fields(data.data, DATA_SOURCES[data.data.source].paths(data.data))
    for zs in data.eval.zeroshot:
        zs.path, zs.classnames = absolute(zs.path), absolute(zs.classnames)
        if zs.templates not in (None, "openai", "simple"):
            zs.templates = absolute(zs.templates)
    if data.checkpoint.resume not in (None, "latest"):
        data.checkpoint.resume = absolute(data.checkpoint.resume)
    return data


def torchrun_command(job_file: Path, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: Optional[str] = None, master_port: Optional[int] = None,
                     python: str = sys.executable, fork_ranks: bool = False) -> list[str]:
    """torchrun for this node: standalone on one node, a static rendezvous on several. Each rank is a new
    interpreter running `-m fsdpclip.train.entry`, or with `fork_ranks` a fork of torchrun running that module's
    file (torchrun's `--run-path --start-method=fork`): forked from a launcher that has imported torch
    and OpenCLIP, the ranks need not import them again."""
    command = [python, "-m", TORCHRUN, f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and master_addr is None:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={master_port}"]
    if fork_ranks:
        return command + ["--run-path", "--start-method=fork", train_module_file(), str(job_file)]
    return command + ["-m", TRAIN_MODULE, str(job_file)]


def train_module_file() -> str:
    """The path of the rank entry's source file (what torchrun's --run-path runs)."""
    import importlib.util

    return importlib.util.find_spec(TRAIN_MODULE).origin


# Variables that act when an interpreter or its shared libraries load (glibc's allocator included): ranks
# forked from the launcher could not honour them from the spec's launch.env.
LOAD_TIME_VARIABLES = ("PYTHON", "LD_", "GLIBC_TUNABLES", "MALLOC_")


def prepare_forked_ranks(job: Job) -> Optional[str]:
    """Make this launcher what its ranks are to be forked from, before it imports torch; returns why they
    cannot be forked (None: they can): the spec asks for new interpreters (launch.fork_ranks false), torch
    was imported already (what it reads at import would not hold), or the spec sets one of
    LOAD_TIME_VARIABLES. Otherwise it takes the job's launch.env, so that the ranks start as new
    interpreters with that environment would, and imports OpenCLIP as they do (without transformers where
    the model has no Hugging Face tower: `model.import_open_clip_as_the_ranks_do`). What torchrun gives
    each rank (its rank, OMP_NUM_THREADS, unbuffered output) the rank applies itself
    (fsdpclip.train.entry.adopt_rank_environment). torchrun itself always runs in a fork of the launcher
    (`ForkedTorchrun`)."""
    if not job.launch.fork_ranks:
        return "launch.fork_ranks is false"
    if "torch" in sys.modules:
        return "this process had imported torch before it could take launch.env"
    loading = [key for key in job.launch.env if key.startswith(LOAD_TIME_VARIABLES)]
    if loading:
        return f"launch.env sets {', '.join(loading)}, read when a process loads"
    os.environ.update(job.launch.env)
    from fsdpclip.model.build import import_open_clip_as_the_ranks_do

    import_open_clip_as_the_ranks_do(job.model)
    return None


# What the ranks' parents (this launcher, torchrun's agent) may do with CUDA: ask NVML whether there is a GPU.
# torchrun's agent asks (torch >= 2.9, for NUMA binding); through the CUDA driver, that would leave every
# process forked from it unable to use CUDA. The ranks inherit it too, where it only changes how
# torch.cuda.is_available() looks (NVML first).
FORK_SAFE_CUDA_CHECK = {"PYTORCH_NVML_BASED_CUDA_CHECK": "1"}


def forking_environment(job: Job, fork_ranks: bool) -> dict[str, str]:
    """What torchrun's environment needs beyond the job's own: FORK_SAFE_CUDA_CHECK where it forks GPU ranks."""
    return dict(FORK_SAFE_CUDA_CHECK) if fork_ranks and job.launch.device == "cuda" else {}


def shown_command(command: list[str], environment: dict[str, str]) -> str:
    """The torchrun command as `launch` prints it, behind the `environment` it needs (`forking_environment`)."""
    return render([*(f"{key}={value}" for key, value in environment.items()), *command])


def cuda_forbids_forked_ranks(job: Job) -> Optional[str]:
    """Why ranks forked from this launcher could not use CUDA (None: they can): it has initialised CUDA, or
    for a GPU job NVML sees no GPU (with one, the agent's check under FORK_SAFE_CUDA_CHECK stays away from
    the driver)."""
    import torch

    if torch.cuda.is_initialized():
        return "this process has initialised CUDA"
    if job.launch.device != "cuda":
        return None
    gpus = nvml_gpu_count()
    if gpus is None:
        return "this torch cannot ask NVML for the GPUs"
    return None if gpus > 0 else "NVML sees no GPU"


def nvml_gpu_count() -> Optional[int]:
    """The GPUs NVML sees, CUDA_VISIBLE_DEVICES applied (negative where NVML fails), asked without the CUDA
    driver (which would leave later forks unable to use CUDA); None where this torch cannot ask."""
    import torch

    try:
        return torch.cuda._device_count_nvml()
    except Exception:  # a private torch function
        return None


def render(command: list[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


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


def sbatch_options(job: Job) -> list[str]:
    """The `#SBATCH` options of a job: its launch and slurm blocks, the logs in RUN_DIR/logs/."""
    launch, slurm = job.launch, job.launch.slurm
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
code=$({{python}} -m fsdpclip.run.directory "$run_dir" "${{launch_time}}" "$status" 2>/dev/null)
{{requeue}}
exit "${code:-$status}"
"""

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
    launch, slurm = job.launch, job.launch.slurm
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


def job_environment(job: Job) -> dict[str, str]:
    """The environment every rank starts with: ours, the spec's, and when the launch began."""
    env = dict(os.environ)
    env.update(job.launch.env)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[LAUNCH_TIME_ENV] = repr(time.time())
    return env


def run_local(job: Job, flags: LaunchFlags, fork_ranks: bool = False) -> dict:
    """Take the run directory (node 0), write RUN_DIR/job.json, run torchrun for this node under
    supervision and wait; returns the exit report, written to exit.json however the job ended
    (torchrun reports any failure of its ranks as 1: the code is the trainer's own where it left one).
    `fork_ranks`: see `torchrun_command` and `prepare_forked_ranks`. The ranks learn this launcher
    (LAUNCHER_ENV) and stop as on a stop request once it is gone; the lock stays held while torchrun or
    rank 0 runs, whatever became of the launcher.
    """
    token, started = uuid.uuid4().hex, time.time()
    env = {**job_environment(job), LOCK_TOKEN_ENV: token, LAUNCHER_ENV: "%d:%d" % process_identity(),
           **forking_environment(job, fork_ranks)}
    lock = HeldLock(job.run_dir, token) if (flags.node_rank or 0) == 0 else None
    try:
        job.run_dir.mkdir(parents=True, exist_ok=True)
        with lock or contextlib.nullcontext():
            job.save(job.run_dir / JOB_FILE)
            keep_output(job.run_dir / LOG_DIR / LAUNCHER_LOG)
            status = supervise(flags.torchrun(job, fork_ranks), env, job.run_dir, lock)
    except RunLocked as exc:
        raise LaunchError(str(exc)) from None
    except OSError as exc:
        raise LaunchError(f"cannot use the run directory {job.run_dir}: {exc.strerror or exc}") from None
    return finish_exit_report(job.run_dir, started, status)


def supervise(command: list[str], env: dict[str, str], run_dir: Path, lock: Optional[HeldLock] = None) -> int:
    """Run `command` (torchrun) in its own session with inherited output (`ForkedTorchrun`), and return its
    exit status; torchrun joins `lock`.

    A first SIGTERM, SIGHUP (the terminal or ssh connection gone) or Ctrl-C to this process (or to its
    process group: the terminal's Ctrl-C, a scheduler's `kill -TERM -PGID`) becomes a stop request in
    RUN_DIR/stop: the ranks checkpoint and exit 75 (no signal reaches torchrun, which would give them
    only 30 s on torch < 2.12). A second SIGTERM or Ctrl-C stops everything at once: SIGKILL to torchrun
    and every process under it (status 130).
    """
    process = ForkedTorchrun(command, env)
    if lock is not None:
        lock.add(process.pid)
    received: list[int] = []

    def handle(signum, frame) -> None:
        if signum == signal.SIGHUP and received:
            return  # a hang-up reaches us from the terminal and from the shell alike: it never stops at once
        received.append(signum)
        if len(received) == 1:
            request_stop(run_dir)
            print(f"fsdpclip: {signal.Signals(signum).name}: the ranks checkpoint and stop at their "
                  "next stop check (again to stop at once)", file=sys.stderr, flush=True)
        else:
            kill_tree(process.pid)

    previous = {signum: signal.signal(signum, handle) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        status = process.wait()
        return STOPPED_AT_ONCE if len(received) > 1 else status
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class ForkedTorchrun:
    """torchrun's command (`python -m fsdpclip.launch.torchrun ARGS`, this interpreter) run in a forked child of this
    process, not a new interpreter: the launcher has imported torch already, which a new one would import
    again before torchrun's agent could start (1.7 s on a 2-core machine, 3.5-5 s on the GPU hosts). The
    child has a session of its own, `env` as its environment and a fresh interpreter's signal handlers, and
    never returns into the launcher's code. `pid` and `wait()` as a Popen's."""

    def __init__(self, command: list[str], env: dict[str, str]):
        if command[:3] != [sys.executable, "-m", TORCHRUN]:
            raise ValueError(f"not this interpreter's torchrun command: {render(command)}")
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os._exit(self._run(command[3:], env))

    @staticmethod
    def _run(args: list[str], env: dict[str, str]) -> int:
        code = 1
        try:
            os.setsid()
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.environ.clear()
            os.environ.update(env)
            tempfile.tempdir = None  # as a new interpreter: the temporary directory from `env` (TMPDIR)
            sys.argv = [TORCHRUN, *args]
            from fsdpclip.launch.torchrun import main

            code = main()
        except SystemExit as exc:  # as the interpreter ends on it: an int is the code, anything else printed
            code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
            if not isinstance(exc.code, (int, type(None))):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        return code

    def wait(self) -> int:
        """The child's exit status: its code, or minus the signal that ended it."""
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every process under it (Linux: their parents read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    tree, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            tree.append(child)
            todo.append(child)
    for member in tree:
        try:
            os.kill(member, signal.SIGKILL)
        except ProcessLookupError:
            pass
