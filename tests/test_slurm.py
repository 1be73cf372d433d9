"""`fsdpclip launch --slurm` on a real Slurm: a throw-away cluster of two fake nodes on this machine.

cluster/local-slurm.sh installs slurm-wlm and munge when they are missing (apt-get, as root),
starts munged, slurmctld and two slurmd from a temporary directory and stops exactly those
daemons (their pid files) afterwards. The tests skip only when Slurm cannot be installed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import PREEMPTIBLE_STEPS, REPO, TINY_CONFIG, assert_same_losses, preemptible_job, write_job
from ranks import run_group
from fsdpclip.checkpoint.layout import latest_checkpoint

pytestmark = pytest.mark.slow  # a local Slurm cluster

CLUSTER = REPO / "cluster" / "local-slurm.sh"
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}


@dataclass
class Slurm:
    """The running test cluster: its directory and the environment that points Slurm's commands at it."""

    directory: Path
    env: dict

    def run(self, *command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=30)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, NodeList, ExitCode, ...)."""
        shown = self.run("scontrol", "-o", "show", "job", job_id)
        assert shown.returncode == 0, shown.stderr
        return dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)

    def wait_until_ended(self, job_id: str, timeout: float = 150) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] not in ENDED:
            if time.monotonic() > deadline:
                self.run("scancel", job_id)
                raise AssertionError(f"job {job_id} still {job['JobState']} after {timeout}s")
            time.sleep(0.5)
        return job

    def submit(self, job_file: Path, *flags: str) -> str:
        """`fsdpclip launch JOB --slurm FLAGS` (as a user would run it); the job id it printed."""
        launched = run_group([sys.executable, "-m", "fsdpclip", "launch", str(job_file), "--slurm", *flags],
                             timeout=60, env={"SLURM_CONF": self.env["SLURM_CONF"]})
        assert launched.returncode == 0, launched.stdout
        return re.search(r"submitted batch job (\d+)", launched.stdout).group(1)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    installed = subprocess.run([str(CLUSTER), "install"], capture_output=True, text=True, timeout=600)
    if installed.returncode != 0:
        pytest.skip(f"Slurm cannot be installed here: {installed.stderr.strip()}")
    directory = tmp_path_factory.mktemp("slurm")
    ports = {"LOCAL_SLURM_PORT": str(_free_ports(3))}  # slurmctld and two slurmd, apart from any other cluster
    started = subprocess.run([str(CLUSTER), "start", str(directory), "2"], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **ports})
    try:
        assert started.returncode == 0, f"the local cluster did not start: {started.stderr}"
        yield Slurm(directory, {**os.environ, "SLURM_CONF": str(directory / "slurm.conf")})
    finally:
        subprocess.run([str(CLUSTER), "stop", str(directory)], capture_output=True, timeout=120)
        shutil.rmtree(directory, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports(count: int) -> int:
    """The first of `count` consecutive free ports."""
    while True:
        first = _free_port()
        try:
            for port in range(first, first + count):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", port))
            return first
        except OSError:
            continue


def _job(tmp_path: Path, steps: int, every: int, **launch) -> Path:
    """A tiny CLIP on synthetic data, 2 CPU ranks unless `launch` says otherwise."""
    return write_job(tmp_path, {
        "run": {"name": "slurm", "output_dir": str(tmp_path / "runs")},
        "model": {"config": str(TINY_CONFIG)},
        "fsdp": {"param_dtype": "fp32"},
        "schedule": {"steps": steps},
        "data": {"source": "synthetic"},
        "batch": {"per_gpu": 16},
        "checkpoint": {"every_steps": every, "keep": 2},
        "logging": {"every_steps": 1},
        "launch": {"gpus_per_node": 2, "device": "cpu", "collective_timeout_s": 60, "master_port": _free_port(),
                   **launch},
    })


def _steps(run_dir: Path) -> list[int]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in records if "loss" in r]


def _logs(run_dir: Path, job_id: str) -> tuple[str, str]:
    """The batch script's output and node 0's (rank 0's) output."""
    logs = run_dir / "logs"
    return (logs / f"slurm-{job_id}.out").read_text(), (logs / f"slurm-{job_id}-node0.out").read_text()


def test_usr1_checkpoints_requeues_and_resumes(slurm, tmp_path, digits_dir, straight_losses):
    """What Slurm does before a time limit, with 2 data workers per rank: USR1 to the batch script ->
    checkpoint -> requeue under the same job id -> resume -> every step done, with the losses of a run
    that was never stopped, a final checkpoint and exit.json's code 0."""
    path = write_job(tmp_path, preemptible_job(tmp_path / "runs", digits_dir, "slurm", master_port=_free_port()))
    job_id = slurm.submit(path)
    run_dir = tmp_path / "runs" / "slurm"
    deadline = time.monotonic() + 90
    while not ((run_dir / "metrics.jsonl").exists() and _steps(run_dir)):  # training has begun
        assert time.monotonic() < deadline and slurm.job(job_id)["JobState"] not in ENDED, "training never began"
        time.sleep(0.2)
    signalled = slurm.run("scancel", "--signal=USR1", "--batch", job_id)  # what Slurm does before the time limit
    assert signalled.returncode == 0, signalled.stderr
    job = slurm.wait_until_ended(job_id)
    batch_log, node_log = _logs(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", batch_log + node_log[-3000:]
    assert (run_dir / "launch.sbatch").is_file() and f"fsdpclip: job {job_id} (restart 0)" in batch_log
    assert "USR1: asking the trainer to checkpoint and stop" in batch_log and f"requeueing job {job_id}" in batch_log
    assert f"fsdpclip: job {job_id} (restart 1)" in batch_log
    assert "Traceback" not in node_log and "killed by signal" not in node_log
    stopped = re.search(r"a stop was requested: stopped after step (\d+); checkpoint saved at (\S+);", node_log)
    assert stopped, node_log[-3000:]
    step, checkpoint = int(stopped.group(1)), stopped.group(2)
    assert step < PREEMPTIBLE_STEPS and checkpoint.endswith(f"step-{step:08d}")
    assert f"resumed from {checkpoint} at step {step}" in node_log
    assert_same_losses(run_dir, straight_losses)
    report = json.loads((run_dir / "exit.json").read_text())
    assert report["code"] == 0 and report["step"] == PREEMPTIBLE_STEPS
    assert latest_checkpoint(run_dir).name == f"step-{PREEMPTIBLE_STEPS:08d}"


def test_two_nodes_as_hsdp(slurm, tmp_path):
    """2 nodes × 2 ranks, sharded inside each node and replicated across them (fsdp.shard_degree 2):
    the batch script's torchrun rendezvous numbers the ranks node by node, so each shard group is a node."""
    path = _job(tmp_path, steps=10, every=10)
    spec = json.loads(path.read_text())
    spec["fsdp"]["shard_degree"] = 2
    path.write_text(json.dumps(spec))
    job_id = slurm.submit(path, "--nodes", "2", "--gpus-per-node", "2")
    job = slurm.wait_until_ended(job_id)
    run_dir = tmp_path / "runs" / "slurm"
    batch_log, node_log = _logs(run_dir, job_id)
    assert job["JobState"] == "COMPLETED" and job["NodeList"] == "node[1-2]", batch_log + node_log[-3000:]
    assert (run_dir / "logs" / f"slurm-{job_id}-node1.out").is_file()
    ranks_logs = "".join(p.read_text() for p in sorted((run_dir / "logs").glob(f"slurm-{job_id}-node*.out")))
    assert "mesh: 2 replica(s) × shard groups of 2" in ranks_logs  # rank 0 is on either node (c10d rendezvous)
    assert json.loads((run_dir / "exit.json").read_text())["code"] == 0
    assert json.loads((latest_checkpoint(run_dir) / "meta.json").read_text())["world_size"] == 4


def test_sbatch_refusal_is_a_user_error(slurm, tmp_path):
    path = _job(tmp_path, steps=1, every=1)
    refused = run_group([sys.executable, "-m", "fsdpclip", "launch", str(path), "--slurm", "--partition", "nosuch"],
                        timeout=60, env={"SLURM_CONF": slurm.env["SLURM_CONF"]})
    assert refused.returncode == 2 and "Traceback" not in refused.stdout, refused.stdout
    assert "sbatch refused" in refused.stdout and "invalid partition" in refused.stdout.lower()
