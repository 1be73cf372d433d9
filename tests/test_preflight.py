"""`fsdpclip launch` checks this node before any process starts: the GPUs, the rendezvous port, the cores for
the data workers, and whether the run is already over. Every finding is a located row (exit 2 for an error);
nothing is started or written."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, squeezed, write_job
from ranks import run_group


def _job(tmp_path: Path, **launch) -> dict:
    return {"run": {"name": "pre", "output_dir": str(tmp_path / "runs"), "seed": 1},
            "model": {"config": str(TINY_CONFIG)}, "fsdp": {"param_dtype": "fp32"},
            "data": {"source": "synthetic", "samples": 64}, "batch": {"per_gpu": 8}, "schedule": {"steps": 3},
            "launch": {"gpus_per_node": 1, "device": "cpu", "collective_timeout_s": 60, **launch}}


def _launch(path: Path, *extra: str, timeout: float = 120):
    return run_group([sys.executable, "-m", "fsdpclip", "launch", str(path), *extra], timeout=timeout)


@pytest.mark.slow
def test_a_gpu_job_on_a_machine_without_one_stops_before_torchrun(tmp_path):
    """A spec without launch.device ('cuda') on a machine with no GPU: one row naming launch.device, exit 2,
    no torchrun started and nothing written (before: torchrun started and died with two tracebacks, exit 1)."""
    job = _job(tmp_path)
    del job["launch"]["device"]
    result = _launch(write_job(tmp_path, job))
    assert result.returncode == 2, result.stdout[-3000:]
    text = squeezed(result.stdout)
    assert "launch.device" in text and "thismachinehasnonevisible" in text, result.stdout
    assert "Traceback" not in result.stdout and "fsdpclip.launch.torchrun" not in result.stdout
    assert not (tmp_path / "runs" / "pre").exists()


def test_fewer_gpus_than_ranks_is_a_located_error(tmp_path, cli, monkeypatch):
    """Two ranks per node where one GPU is visible: the row names launch.gpus_per_node and how many there are."""
    from fsdpclip.validate import preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda: (1, "NVML sees 1"))
    result = cli("launch", write_job(tmp_path, _job(tmp_path, device="cuda", gpus_per_node=2)))
    assert result.exit_code == 2, result.output
    assert "launch.gpus_per_node" in result.output and "atmost1" in squeezed(result.output), result.output
    assert not (tmp_path / "runs" / "pre").exists()


def test_the_nodes_rows_stand_beside_the_specs(tmp_path, cli, monkeypatch):
    """A GPU job on a machine without one: the node's row (launch.device) comes in the same round as the spec's
    (a data path, and a key that does not parse), not after they are fixed."""
    from fsdpclip.validate import preflight

    monkeypatch.setattr(preflight, "visible_gpus", lambda: (0, "no NVIDIA driver is loaded (no /dev/nvidiactl)"))
    job = _job(tmp_path, device="cuda")
    job["data"] = {"urls": str(tmp_path / "missing-{0..3}.tar"), "samples": 64, "resampled": True}
    for extra, rows in (({}, ["data.urls", "launch.device"]),
                        ({"fsdp": {"param_dtype": "fp32", "reshard": True}}, ["fsdp.reshard", "data.urls",
                                                                               "launch.device"])):
        result = cli("launch", write_job(tmp_path, {**job, **extra}))
        assert result.exit_code == 2, result.output
        errors = [row.split("│")[2].strip() for row in result.output.splitlines() if "│ ✗" in row]
        assert errors == rows, result.output
    assert not (tmp_path / "runs" / "pre").exists()


@pytest.mark.slow
def test_a_busy_rendezvous_port_and_too_many_workers(tmp_path, digits_dir):
    """Node 0 of a 2-node launch whose rendezvous port is taken on this host: an error row for
    launch.master_port (exit 2, before torchrun would wait for the other node), beside one warning row (not one
    from validate's checks and another from the node's) for more data workers than this node has cores."""
    job = _job(tmp_path, nodes=2, gpus_per_node=2)
    cores = len(os.sched_getaffinity(0))  # as many workers per rank as the node has cores: 2 ranks are too many
    job["data"] = {"urls": str(digits_dir / "train-{000000..000007}.tar"), "samples": 1438, "workers": cores,
                   "resampled": True}
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = _launch(write_job(tmp_path, job), "--node-rank", "0", "--master-addr", "127.0.0.1",
                         "--master-port", str(port), timeout=60)
    text = squeezed(result.stdout)
    assert result.returncode == 2, result.stdout[-3000:]
    assert "launch.master_port" in text and "inuseonthishost" in text, result.stdout
    assert text.count("data.workers") == 1 and f"{cores}workers×2rankspernode={2 * cores}dataworkers" in text, \
        result.stdout
    assert not (tmp_path / "runs" / "pre").exists()


@pytest.mark.slow
def test_relaunching_a_finished_run_starts_nothing(tmp_path, cli):
    """A run that trained all its steps, launched again (in-process): it says so with the run directory and the
    next commands, exit 0, and starts no rank (no torchrun, no new launch record, metrics untouched). A longer
    schedule trains on, once its LR's jump at the resume step is accepted."""
    path = write_job(tmp_path, _job(tmp_path))
    first = _launch(path)
    assert first.returncode == 0, first.stdout[-3000:]
    run_dir = tmp_path / "runs" / "pre"
    launches, metrics = sorted((run_dir / "launches").iterdir()), (run_dir / "metrics.jsonl").read_bytes()
    again = cli("launch", path)
    assert again.exit_code == 0, again.output[-3000:]
    assert "✓ already finished: step 3 of 3, nothing to train" in again.output, again.output
    assert f"next: fsdpclip report {run_dir}" in again.output
    assert "fsdpclip.launch.torchrun" not in again.output
    assert sorted((run_dir / "launches").iterdir()) == launches and (run_dir / "metrics.jsonl").read_bytes() == metrics
    refused = cli("launch", path, "--set", "schedule.steps=4")
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output[-3000:]
    code, out = cli.validate_json(path, "--set", "schedule.steps=4")
    assert code == 2 and out["errors"][0]["message"].endswith("the LR of step 4, where it resumes: 0 → 7.32e-05 "
                                                              "(its schedule recomputed over the new length)"), out
    more = _launch(path, "--set", "schedule.steps=4", "--accept-changes")
    assert more.returncode == 0 and json.loads((run_dir / "exit.json").read_text())["step"] == 4, more.stdout[-3000:]
