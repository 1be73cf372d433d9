"""`fsdpclip env`: the node report a bug report asks for, whole on a machine without GPUs, Slurm jobs or
InfiniBand."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fsdpclip.validate import environment

KEYS = {"fsdpclip", "python", "platform", "packages", "extras", "torch", "gpus", "gpu_topology", "infiniband", "slurm",
        "cpu_cores", "host_memory_gib", "run_root"}


def test_env_json_reports_every_piece_on_this_machine(cli, tmp_path):
    """`--json` prints one object with every piece: the required packages' versions, the extras (installed or
    not), torch's CUDA and NCCL, the GPUs (none here, and why), cores, memory and the run root, which does not
    exist yet and can be made."""
    result = cli("env", "--json", "--run-root", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    found = json.loads(result.output)
    assert set(found) == KEYS
    assert set(found["packages"]) == set(environment.REQUIRED)
    assert environment.NOT_INSTALLED not in found["packages"].values()
    assert set(found["extras"]) == set(environment.EXTRAS)
    assert set(found["torch"]) == {"version", "cuda", "nccl", "cuda_available"}
    assert found["gpus"]["count"] == len(found["gpus"]["devices"]) and found["gpus"]["source"]
    assert set(found["slurm"]) == {"sbatch", "srun", "job"}
    assert found["cpu_cores"]["usable"] >= 1 and found["host_memory_gib"] > 0
    root = found["run_root"]
    assert (root["path"], root["exists"], root["writable"], root["why"]) == (str(tmp_path / "runs"), False, True, None)
    assert root["free_gib"] >= 0
    assert not (tmp_path / "runs").exists() and list(tmp_path.iterdir()) == []  # its probe leaves nothing


def test_env_table_names_each_piece(cli, tmp_path):
    result = cli("env", "--run-root", tmp_path)
    assert result.exit_code == 0, result.output
    for row in ("open_clip_torch", "safetensors", "NCCL (torch)", "GPUs", "InfiniBand", "Slurm", "CPU cores",
                "host memory", "run root"):
        assert row in result.output, row


def test_a_read_only_run_root_is_not_writable(tmp_path):
    """A directory no file can be created in (sysfs refuses even root; a 0o555 directory refuses other users) is
    reported not writable, with why; a path through a file too."""
    refused = environment.run_root_status(Path("/sys/class/fsdpclip-runs"))
    assert not refused["writable"] and "/sys/class" in refused["why"], refused
    (tmp_path / "file").write_text("")
    through_file = environment.run_root_status(tmp_path / "file" / "runs")
    assert not through_file["writable"] and "not a directory" in through_file["why"]
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o555)
        assert not environment.run_root_status(locked)["writable"]


def test_missing_pieces_are_reported_as_missing(tmp_path, monkeypatch):
    """A distribution that is not installed, no nvidia-smi, no InfiniBand: reported, never an error; with an
    nvidia-smi on PATH its `topo -m` is in the report, and InfiniBand ports are read from sysfs."""
    assert environment.package_versions(("no-such-distribution",)) == {"no-such-distribution": "not installed"}
    monkeypatch.setenv("PATH", str(tmp_path))
    assert environment.gpu_topology() is None
    assert environment.slurm()["sbatch"] is None
    assert environment.infiniband_devices(tmp_path / "absent") == []
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n[ \"$1 $2\" = 'topo -m' ] && echo '        GPU0    NIC0' && exit 0\nexit 9\n")
    smi.chmod(0o755)
    assert environment.gpu_topology() == "        GPU0    NIC0"
    port = tmp_path / "ib" / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text("4: ACTIVE\n")
    (port / "rate").write_text("400 Gb/sec (4X NDR)\n")
    assert environment.infiniband_devices(tmp_path / "ib") == [{"name": "mlx5_0", "ports": [
        {"port": "1", "state": "4: ACTIVE", "rate": "400 Gb/sec (4X NDR)", "link_layer": None}]}]


def test_a_slurm_jobs_variables_are_reported(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURMISH", "no")
    assert environment.slurm()["job"]["SLURM_JOB_ID"] == "4242" and "SLURMISH" not in environment.slurm()["job"]


def test_a_rank_takes_its_share_of_the_node_cores(monkeypatch):
    """What an offloaded optimizer step and a checkpoint's writer threads use: the node's usable cores over its
    ranks, never less than one."""
    from fsdpclip.checkpoint.staging import write_threads
    from fsdpclip.run.node import cores_per_local_rank

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    for ranks, share, writers in (("1", 16, 8), ("4", 4, 4), ("32", 1, 1)):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert (cores_per_local_rank(), write_threads()) == (share, writers)
