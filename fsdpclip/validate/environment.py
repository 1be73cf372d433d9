"""`fsdpclip env`: this node as a bug report needs it: versions, GPUs and their links, InfiniBand devices,
Slurm, cores and memory, and whether the run root can be written. Each piece is looked for, never required:
a missing one (no GPU, no nvidia-smi, no Slurm) is reported as missing. torch loads inside the functions."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Optional

from fsdpclip.run.node import host_memory
from fsdpclip.validate.preflight import visible_gpus

NOT_INSTALLED = "not installed"
REQUIRED = ("torch", "open_clip_torch", "pydantic", "typer", "rich", "webdataset")
EXTRAS = ("transformers", "tensorboard", "wandb", "safetensors")
INFINIBAND = Path("/sys/class/infiniband")
TOPOLOGY_TIMEOUT_S = 30


def environment(run_root: Path) -> dict:
    """The whole report, as `fsdpclip env --json` prints it."""
    from fsdpclip import __version__

    return {"fsdpclip": __version__, "python": sys.version.split()[0], "platform": platform.platform(),
            "packages": package_versions(REQUIRED), "extras": package_versions(EXTRAS), "torch": torch_build(),
            "gpus": gpus(), "gpu_topology": gpu_topology(), "infiniband": infiniband_devices(), "slurm": slurm(),
            "cpu_cores": {"usable": len(os.sched_getaffinity(0)), "total": os.cpu_count()},
            "host_memory_gib": round(host_memory() / 2 ** 30, 1), "run_root": run_root_status(run_root)}


def package_versions(names: tuple[str, ...]) -> dict[str, str]:
    """Each distribution's installed version, or 'not installed'."""
    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = NOT_INSTALLED
    return found


def torch_build() -> dict:
    """The CUDA and NCCL versions as torch sees them (None where it is built without them)."""
    import torch

    try:
        from torch.cuda import nccl as torch_nccl

        nccl: Optional[str] = ".".join(map(str, torch_nccl.version())) if torch.backends.cuda.is_built() else None
    except Exception:  # noqa: BLE001  (a build without NCCL, a library that fails to load)
        nccl = None
    return {"version": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
            "cuda_available": torch.cuda.is_available()}


def gpus() -> dict:
    """The GPUs this process may use (`preflight.visible_gpus`: how many and who says so), each with its memory."""
    import torch

    count, source = visible_gpus()
    devices = []
    if count != 0 and torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2 ** 30, 1),
                            "capability": f"{props.major}.{props.minor}"})
    return {"count": len(devices) if devices else max(count, 0), "source": source, "devices": devices}


def gpu_topology() -> Optional[str]:
    """`nvidia-smi topo -m` (how the GPUs and NICs connect), or None where there is no nvidia-smi; what went
    wrong where it fails."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "topo", "-m"], capture_output=True, text=True, timeout=TOPOLOGY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi topo -m failed: {exc}"
    return done.stdout.rstrip() if done.returncode == 0 else \
        f"nvidia-smi topo -m exited {done.returncode}: {(done.stderr or done.stdout).strip()}"


def infiniband_devices(root: Path = INFINIBAND) -> list[dict]:
    """The InfiniBand (and RoCE) devices under /sys/class/infiniband, each port's state, rate and link layer."""
    if not root.is_dir():
        return []
    return [{"name": device.name, "ports": [
        {"port": port.name, **{key: _read(port / key) for key in ("state", "rate", "link_layer")}}
        for port in sorted((device / "ports").iterdir()) if (device / "ports").is_dir()]}
        for device in sorted(root.iterdir())]


def _read(path: Path) -> Optional[str]:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def slurm() -> dict:
    """sbatch and srun on PATH, and the SLURM_* variables of a job this runs in."""
    return {"sbatch": shutil.which("sbatch"), "srun": shutil.which("srun"),
            "job": {name: value for name, value in sorted(os.environ.items()) if name.startswith("SLURM_")}}


def run_root_status(run_root: Path) -> dict:
    """Whether run directories can be made under `run_root`: a file is created (and removed) in it, or in the
    nearest directory above it that exists; with the free space there."""
    path = Path(run_root).absolute()
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    status = {"path": str(path), "exists": path.exists(), "writable": False, "free_gib": None, "why": None}
    if not existing.is_dir():
        return {**status, "why": f"{existing} is not a directory"}
    status["free_gib"] = round(shutil.disk_usage(existing).free / 2 ** 30, 1)
    try:
        with tempfile.TemporaryFile(dir=existing, prefix=".fsdpclip-env-"):
            pass
    except OSError as exc:
        return {**status, "why": f"cannot write in {existing}: {exc.strerror or exc}"}
    return {**status, "writable": True}
