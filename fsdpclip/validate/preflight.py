"""What `fsdpclip launch` checks on this node before any process starts: what `validate` cannot know
elsewhere (the GPUs here, the rendezvous port) and whether the run in its directory is already over
(the data workers against this node's cores are `validate`'s check, which launch runs here first). Each
finding is a located `Problem`; nothing here loads torch at import (the GPU count asks NVML, never the
CUDA driver, so ranks forked from the launcher can still use CUDA).
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import Optional

from fsdpclip.launch.local import nvml_compute_capabilities, nvml_gpu_count
from fsdpclip.jobspec.problems import Report
from fsdpclip.jobspec.job import Job


def preflight(job: Job, node_rank: int = 0, static_rendezvous: bool = False) -> Report:
    """The problems of starting `job`'s ranks on this node (`node_rank`; `static_rendezvous`: node 0 serves
    the rendezvous on launch.master_port, as without --standalone)."""
    launch = job.launch
    report = Report(launch.world_size, launch.gpus_per_node)
    if launch.device == "cuda":
        _check_gpus(launch.gpus_per_node, report)
        if job.fsdp.float8 is True:
            _check_float8_gpus(report)
    if static_rendezvous and node_rank == 0:
        _check_port(launch.master_port, report)
    return report


def visible_gpus() -> tuple[int, str]:
    """How many GPUs this process may use (CUDA_VISIBLE_DEVICES applied), and where the number comes from;
    negative where it cannot be told without the CUDA driver (MIG devices, NVML failing beside a driver)."""
    import torch

    if not torch.backends.cuda.is_built():
        return 0, f"this torch ({torch.__version__}) is built without CUDA"
    count = nvml_gpu_count()
    if count is None or count < 0:
        if not Path("/dev/nvidiactl").exists():
            return 0, "no NVIDIA driver is loaded (no /dev/nvidiactl)"
        return -1, "NVML cannot tell"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return count, f"NVML sees {count}" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")


def _check_gpus(ranks: int, report: Report) -> None:
    count, source = visible_gpus()
    if count == 0:
        report.error("launch.device", f"'cuda' asks for GPUs and this machine has none visible: {source}", "cuda",
                     hint="run on a GPU node, or set launch.device to 'cpu' (gloo; tests and demos)")
    elif 0 < count < ranks:
        report.error("launch.gpus_per_node", f"{ranks} ranks on this node, one per GPU, and {source} GPU(s)", ranks,
                     hint=f"set launch.gpus_per_node (or --gpus-per-node) to at most {count}")


def _check_float8_gpus(report: Report) -> None:
    """`fsdp.float8: true`: this node's GPUs have float8 GEMMs (where NVML tells their compute capability)."""
    from fsdpclip.model.float8 import FLOAT8_CAPABILITY, capability_problem

    oldest = min(nvml_compute_capabilities() or [FLOAT8_CAPABILITY])
    if oldest < FLOAT8_CAPABILITY:
        report.error("fsdp.float8", capability_problem("this node's GPU", oldest), True, hint="leave it 'auto'")


def _check_port(port: int, report: Report) -> None:
    """The rendezvous port is free on this host (torchrun's store listens on it on node 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("", port))
        except OSError as exc:
            taken = exc.errno == errno.EADDRINUSE
            report.error("launch.master_port", "in use on this host (another job's rendezvous?)" if taken
                         else f"cannot be listened on: {exc.strerror or exc}", port,
                         hint="choose another port: --master-port P on every node")


def already_finished(job: Job) -> Optional[str]:
    """Why relaunching `job` would train nothing (its checkpoint is at or past its last step, as the trainer
    would compute it from that checkpoint), else None."""
    from fsdpclip.checkpoint.layout import CheckpointError, read_meta, resume_candidates
    from fsdpclip.jobspec.resume import kept_streams, spec_changes

    try:
        candidates, _ = resume_candidates(job.run_dir, job.checkpoint.resume)
        meta = read_meta(candidates[0]) if candidates else None
    except (CheckpointError, OSError, ValueError):
        return None  # the trainer says what is wrong with them
    if meta is None:
        return None
    step, world = meta["step"], job.launch.world_size
    streams = kept_streams(meta, job, spec_changes(meta.get("job", {}), job), world)
    total = job.total_steps(world, step, meta.get("samples_seen", 0), streams)
    if total is None or step < total:
        return None
    return f"already finished: step {step} of {total}, nothing to train"
