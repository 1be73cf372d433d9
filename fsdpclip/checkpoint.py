"""Sharded checkpoints: save, find, resume and export to OpenCLIP's format.

A checkpoint is a directory `RUN_DIR/checkpoints/step-NNNNNNNN/` holding the model and
optimizer as a torch.distributed.checkpoint (any world size can load it), one small file of
rank-local state per rank (RNG, data position) and `meta.json` (step, schedule, scaler),
written last. Every checkpoint is written under a hidden `.partial` name and renamed into
place only when complete; `checkpoints/latest` names the newest complete one. A crash while
saving leaves at most a `.partial` directory, which is never loaded and is cleared on the
next start.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdpclip.rundir import JOB_FILE, write_atomically
from fsdpclip.spec import CheckpointSpec, Job

CHECKPOINTS, LATEST, META = "checkpoints", "latest", "meta.json"
PARTIAL_SUFFIX = ".partial"


class CheckpointError(Exception):
    """A checkpoint that cannot be used (message meant for the user)."""


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_complete(path: Path) -> bool:
    return path.is_dir() and not path.name.endswith(PARTIAL_SUFFIX) and (path / META).is_file()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step-*") if is_complete(p)] if root.is_dir() else []
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Optional[Path]:
    """The newest complete checkpoint: the one `latest` names, else the newest found."""
    root = Path(run_dir) / CHECKPOINTS
    pointer = root / LATEST
    if pointer.is_file():
        named = root / pointer.read_text().strip()
        if is_complete(named):
            return named
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory from a checkpoint or run directory; CheckpointError if there is none."""
    path = Path(path)
    if is_complete(path):
        return path
    if path.is_dir():
        found = latest_checkpoint(path)
        if found is not None:
            return found
    raise CheckpointError(f"{path} is neither a complete checkpoint (a directory with {META}) "
                          f"nor a run directory with one under {CHECKPOINTS}/")


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META).read_text())


def run_job(checkpoint: Path) -> Optional[Job]:
    """The spec of the run that saved `checkpoint` (its run directory's job.json), if it can be read."""
    from fsdpclip.problems import SpecError
    from fsdpclip.jobfile import load_job

    path = Path(checkpoint).parent.parent / JOB_FILE
    try:
        return load_job(path) if path.is_file() else None
    except SpecError:
        return None


def rng_state(device: torch.device) -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


class Checkpointer:
    """Saves and loads one run's checkpoints on every rank (rank 0 does the renaming)."""

    def __init__(self, run_dir: Path, spec: CheckpointSpec, rank: int, world_size: int):
        self.root = Path(run_dir) / CHECKPOINTS
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.pending: Optional[tuple] = None  # (future, partial dir, final dir, meta)
        self.async_group = None
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*" + PARTIAL_SUFFIX):  # left by a crash while saving
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # ------------------------------------------------------------------- saving
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
             rank_state: dict, asynchronous: bool = False) -> Path:
        """Write checkpoint `step` (every rank calls it); returns its final path."""
        self.finish_pending(wait=True)
        final = self.root / checkpoint_name(step)
        partial = self.root / (final.name + PARTIAL_SUFFIX)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        self._write_rank_state(partial, rank_state)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        meta = {**meta, "step": step, "world_size": self.world_size, "saved_at": time.time()}
        if asynchronous:
            if self.async_group is None:
                self.async_group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.async_group)
            self.pending = (future, partial, final, meta)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._finalize(partial, final, meta)
            dist.barrier()
        return final

    def _write_rank_state(self, partial: Path, rank_state: dict) -> None:
        torch.save(rank_state, partial / f"rank-{self.rank:05d}.pt")

    def finish_pending(self, wait: bool) -> None:
        """Complete an asynchronous save once its writes are done (or wait for them)."""
        if self.pending is None:
            return
        future, partial, final, meta = self.pending
        if not wait and not future.done():
            return
        future.result()
        self.pending = None
        self._finalize(partial, final, meta)

    def _finalize(self, partial: Path, final: Path, meta: dict) -> None:
        """Rank 0: meta.json last, rename into place, point `latest` at it, drop old ones."""
        if self.rank != 0:
            return
        write_atomically(partial / META, json.dumps(meta, indent=2))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        write_atomically(self.root / LATEST, final.name + "\n")
        for old in complete_checkpoints(self.root.parent)[:-self.spec.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def resume_target(self) -> Optional[Path]:
        """What the spec says to resume from: the run's latest, a given checkpoint, or nothing.

        Rank 0 decides and every rank follows: ranks looking on their own could see different
        checkpoints on a shared filesystem whose caches lag."""
        resume, chosen = self.spec.resume, [(None, None)]  # (checkpoint, why none can be used)
        if self.rank == 0 and resume is not None:
            try:
                chosen[0] = (latest_checkpoint(self.root.parent) if resume == "latest"
                             else resolve_checkpoint(Path(resume)), None)
            except CheckpointError as exc:
                chosen[0] = (None, str(exc))
        dist.broadcast_object_list(chosen, src=0)
        checkpoint, error = chosen[0]
        if error is not None:
            raise CheckpointError(error)
        return checkpoint

    def load(self, checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, Optional[dict]]:
        """Load model and optimizer (resharded to this world size); (meta, this rank's state or None).

        Rank-local state comes back only when the world size is the one that saved it.
        """
        meta = read_meta(checkpoint)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=str(checkpoint))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rank_file = checkpoint / f"rank-{self.rank:05d}.pt"
        same_world = meta["world_size"] == self.world_size and rank_file.is_file()
        rank_state = torch.load(rank_file, weights_only=False) if same_world else None
        return meta, rank_state


# ----------------------------------------------------------------------- export
def read_model_state(checkpoint: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state of a sharded checkpoint, read by this process alone onto the CPU.

    `model` (usually on the meta device) gives the keys, shapes and dtypes.
    """
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, checkpoint_id=str(checkpoint), no_dist=True)
    except Exception as exc:  # DCP reports a mismatch in many forms
        raise CheckpointError(f"{checkpoint} does not match the model: {str(exc).strip()[:300]}") from None
    return state


def export_checkpoint(checkpoint: Path, model: nn.Module, out: Path, config: dict, safetensors: bool = False) -> Path:
    """Write the model of a sharded checkpoint as one OpenCLIP checkpoint, in one process.

    `out` is a file (`.pt`, `.bin`, `.safetensors`) or a directory laid out for open_clip's
    `local-dir:` (open_clip_config.json beside the weights). `model` is the unwrapped model on
    the meta device: its full state is allocated once on the CPU, filled from the checkpoint
    and written from the same tensors. Returns the weights file written.
    """
    from fsdpclip.model import SHARED_PARAMETERS

    state = read_model_state(checkpoint, model)
    for name in SHARED_PARAMETERS:  # OpenCLIP keeps them 0-d
        if name in state:
            state[name] = state[name].reshape(())
    out = Path(out)
    safetensors = safetensors or out.suffix == ".safetensors"
    if out.suffix not in (".pt", ".bin", ".pth", ".safetensors"):
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(out / "open_clip_config.json", json.dumps(
            {"model_cfg": config, "preprocess_cfg": model.visual.preprocess_cfg}, indent=2))
        out = out / ("open_clip_model.safetensors" if safetensors else "open_clip_pytorch_model.bin")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + PARTIAL_SUFFIX)
    if safetensors:
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(partial))
    else:
        torch.save({"state_dict": state}, partial)
    partial.replace(out)
    return out
