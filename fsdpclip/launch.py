"""Render the commands that start a job and run or submit them.

Three ways to start a job: torchrun on this node (`torchrun_command`; with a static rendezvous
when the job spans nodes and you start each node yourself), or a Slurm batch script
(`sbatch_script`) that starts torchrun on every node of its allocation. Rendering is pure string
building; `run_command` starts a process, streams its output and stops it cleanly on Ctrl-C, and
`submit` hands a batch script to sbatch.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from fsdpclip.data import is_local
from fsdpclip.metrics import LAUNCH_TIME_ENV
from fsdpclip.spec import Job

TRAIN_MODULE = "fsdpclip.train"
STOP_GRACE_S = 30
LOG_DIR = "logs"
BATCH_SCRIPT = "launch.sbatch"


class SubmitError(Exception):
    """sbatch refused a batch script (its message)."""


def resolve_paths(job: Job, base: Path) -> Job:
    """The job with every local path made absolute (relative ones are relative to `base`)."""

    def absolute(path: Optional[str]) -> Optional[str]:
        return None if path is None else str((base / path).resolve()) if is_local(path) else path

    data = job.model_copy(deep=True)
    data.run.output_dir = absolute(job.run.output_dir)
    model = data.model
    model.config, model.pretrained = absolute(model.config), absolute(model.pretrained)
    model.image.pretrained, model.text.pretrained = absolute(model.image.pretrained), absolute(model.text.pretrained)
    if model.text.hf is not None:
        model.text.hf.path = absolute(model.text.hf.path)
    if model.image.timm is not None:
        model.image.timm.path = absolute(model.image.timm.path)
        if isinstance(model.image.timm.pretrained, str):
            model.image.timm.pretrained = absolute(model.image.timm.pretrained)
    if data.data.source == "webdataset":
        urls = data.data.urls
        data.data.urls = absolute(urls) if isinstance(urls, str) else [absolute(u) for u in urls]
    for zs in data.eval.zeroshot:
        zs.path, zs.classnames = absolute(zs.path), absolute(zs.classnames)
        if zs.templates not in (None, "openai", "simple"):
            zs.templates = absolute(zs.templates)
    if data.checkpoint.resume not in (None, "latest"):
        data.checkpoint.resume = absolute(data.checkpoint.resume)
    return data


def torchrun_command(job_file: Path, nproc_per_node: int, nnodes: int = 1, node_rank: int = 0,
                     master_addr: Optional[str] = None, master_port: Optional[int] = None,
                     python: str = sys.executable) -> list[str]:
    """torchrun for this node: standalone on one node, a static rendezvous on several."""
    command = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1 and master_addr is None:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={master_port}"]
    return command + ["-m", TRAIN_MODULE, str(job_file)]


def render(command: list[str]) -> str:
    return " ".join(shlex.quote(part) for part in command)


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
    return [shlex.quote(option) for option in options] + slurm.extra_sbatch


# The batch script after its options, exports and setup lines; {{name}} is filled in. The exit code
# comes from exit.json as `exit_report` reads it for launches without Slurm.
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
    {{python}} -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node={{nproc}} \
    --rdzv-backend=c10d --rdzv-endpoint="$head_addr:{{port}}" --rdzv-id="$SLURM_JOB_ID" \
    -m {{train_module}} {{job_file}} &
step=$!
wait "$step"; status=$?
while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done  # a trapped signal ends `wait` early

# torchrun reports any failure as 1: use the code the trainer's rank 0 wrote to exit.json in this run.
code=$({{python}} -c 'import json, sys; r = json.load(open(sys.argv[1])); print(r["code"] if r["time"] >= float(sys.argv[2]) else "")' \
    "$run_dir/exit.json" "${{launch_time}}" 2>/dev/null)
{{requeue}}
exit "${code:-$status}"
"""

SBATCH_TRAP = r"""
# Preemption or the time limit: Slurm sends USR1 to this script only (--signal=B:USR1@S). It
# becomes SIGTERM to the job step (torchrun would die of USR1 and orphan its workers): every
# rank finishes its step, checkpoints and exits 75; torchrun waits for them.
preempted=
trap 'preempted=1; echo "fsdpclip: USR1: stopping the trainer with SIGTERM"; scancel --signal=TERM "$SLURM_JOB_ID"' USR1
"""

SBATCH_REQUEUE = r"""
if [ -n "$preempted" ] && [ "$code" = 75 ]; then
    echo "fsdpclip: checkpoint saved; requeueing job $SLURM_JOB_ID (it resumes from checkpoints/latest)"
    scontrol requeue "$SLURM_JOB_ID"
fi
"""


def sbatch_script(job: Job, python: Optional[str] = None) -> str:
    """The batch script of `launch --slurm` for a job with resolved paths.

    One srun task per node runs torchrun, which meets the other nodes at a c10d rendezvous on
    the first node and starts the trainer on RUN_DIR/job.json. With requeue on, Slurm's USR1
    becomes SIGTERM to the job step, the ranks checkpoint and exit 75, and the script requeues
    the job, which resumes from checkpoints/latest. `python` defaults to this interpreter, or to
    `python` on the PATH when the spec's setup lines choose the environment.
    """
    launch, slurm = job.launch, job.launch.slurm
    environment = {"PYTHONUNBUFFERED": "1", **launch.env, **slurm.env}
    if slurm.requeue:  # torchrun's grace for its workers after SIGTERM: what Slurm leaves before the limit
        environment["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = str(slurm.signal_seconds)
    head = [
        ["#!/bin/bash",
         f"# fsdpclip job {job.run.name}: {launch.nodes} node(s) x {launch.gpus_per_node} rank(s) ({launch.device}),",
         "# rendered by `fsdpclip launch --slurm` (see cluster/README.md).",
         *(f"#SBATCH {option}" for option in sbatch_options(job))],
        [f"export {key}={shlex.quote(value)}" for key, value in environment.items()],
        list(slurm.setup),
    ]
    values = {
        "run_dir": shlex.quote(str(job.run_dir)),
        "launch_time": LAUNCH_TIME_ENV,
        "port": str(launch.master_port),
        "trap": SBATCH_TRAP if slurm.requeue else "",
        "cpus": f" --cpus-per-task={slurm.cpus_per_task}" if slurm.cpus_per_task is not None else "",
        "node_log": shlex.quote(str(job.run_dir / LOG_DIR / "slurm-%j-node%n.out")),
        "python": shlex.quote(python or ("python" if slurm.setup else sys.executable)),
        "nproc": str(launch.gpus_per_node),
        "train_module": TRAIN_MODULE,
        "job_file": shlex.quote(str(job.run_dir / "job.json")),
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


def exit_report(run_dir: Path, since: float) -> Optional[dict]:
    """What the trainer's rank 0 reported about how the run ended (if it did, after `since`)."""
    import json

    path = Path(run_dir) / "exit.json"
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return report if report.get("time", 0) >= since else None


def run_command(command: list[str], env: dict[str, str]) -> int:
    """Run `command` with inherited output and return its exit code.

    On Ctrl-C the terminal has already signalled the whole process group; give the ranks time
    to stop, then insist: SIGINT, SIGTERM, SIGKILL.
    """
    process = subprocess.Popen(command, env=env)
    try:
        return process.wait()
    except KeyboardInterrupt:
        for stop, grace in ((None, 5), (signal.SIGINT, STOP_GRACE_S), (signal.SIGTERM, STOP_GRACE_S),
                            (signal.SIGKILL, None)):
            if process.poll() is not None:
                break
            if stop is not None:
                process.send_signal(stop)
            try:
                process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue
        return 130
