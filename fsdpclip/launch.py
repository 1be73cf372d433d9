"""Render the commands that start a job (torchrun on this node) and run them.

Rendering is pure string building; `run_command` starts the process, streams its output
and stops it cleanly on Ctrl-C.
"""

from __future__ import annotations

import os
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


def resolve_paths(job: Job, base: Path) -> Job:
    """The job with every local path made absolute (relative ones are relative to `base`)."""

    def absolute(path: Optional[str]) -> Optional[str]:
        return None if path is None else str((base / path).resolve()) if is_local(path) else path

    data = job.model_copy(deep=True)
    data.run.output_dir = absolute(job.run.output_dir)
    model = data.model
    model.config, model.pretrained = absolute(model.config), absolute(model.pretrained)
    model.image.pretrained, model.text.pretrained = absolute(model.image.pretrained), absolute(model.text.pretrained)
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
