"""Sharded checkpoints: save, find, resume and export to OpenCLIP's format.

A checkpoint is a directory `RUN_DIR/checkpoints/step-NNNNNNNN/` holding the model and
optimizer as a torch.distributed.checkpoint (any world size can load it), one small file of
rank-local state per rank (RNG, data position) and `meta.json` (step, schedule, scaler),
written last. Every checkpoint is written under a hidden `.partial` name and renamed into
place only when complete; `checkpoints/latest` names the newest complete one. A crash while
saving leaves at most a `.partial` directory, which is never loaded and is cleared on the
next start. An asynchronous save copies the state into spare device memory when the device has it (a
device-to-device copy: training waits milliseconds) and leaves the copy to the host and the writes to a
background thread; without that memory it copies to the host first (training waits for the copy).
Nothing is read in a way that can run code (`fsdpclip.checkpoint.pickles`): a checkpoint with a file
that cannot be read, or whose pickle names anything but plain data, is passed over for the one before it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from fsdpclip.checkpoint.pickles import PickleRefused, SafeLoadPlanner, SafeReader, load_weights_only, read_dcp_metadata
from fsdpclip.run.directory import JOB_FILE
from fsdpclip.run.files import disk_free, no_space_message, write_atomically
from fsdpclip.spec.job import CheckpointSpec, Job

CHECKPOINTS, LATEST, META = "checkpoints", "latest", "meta.json"
log = logging.getLogger("fsdpclip.checkpoint.sharded")
PARTIAL_SUFFIX = ".partial"
IDLE, WRITING, FAILED = 0, 1, 2  # an asynchronous write's status (`Checkpointer.write_status`)


class CheckpointError(Exception):
    """A checkpoint that cannot be used (message meant for the user)."""


class DiskFull(CheckpointError):
    """A checkpoint that does not fit on its disk: nothing of it is published, the last complete one stays latest."""


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
                          f"nor a run directory with one under {CHECKPOINTS}/{_checkpoints_there(path)}")


def _checkpoints_there(path: Path) -> str:
    """The complete checkpoints of the run a missing checkpoint path points into, for its error."""
    run_dir = path.parent.parent if path.parent.name == CHECKPOINTS else path
    if not (run_dir / CHECKPOINTS).is_dir():
        return ""
    found = [p.name for p in complete_checkpoints(run_dir)]
    if not found:
        return f"; {run_dir / CHECKPOINTS} holds no complete checkpoint"
    return f"; {run_dir / CHECKPOINTS} holds {', '.join(found)} (checkpoint.keep removes older ones)"


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META).read_text())


def rank_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / f"rank-{rank:05d}.pt"


def read_rank_state(path: Path) -> dict:
    """One rank's saved state (RNG, data position), read weights-only; CheckpointError saying what is wrong."""
    if not path.is_file():
        raise CheckpointError(f"{path.name} is missing")
    try:
        return load_weights_only(path, path.name)
    except PickleRefused as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # torch reports a truncated or damaged file in many forms
        first = " ".join(str(exc).split()).split(". ")[0][:200]  # what follows is torch's advice on its internals
        raise CheckpointError(f"{path.name} is truncated or damaged ({type(exc).__name__}: {first})") from None


def checkpoint_problem(checkpoint: Path, rank_state: bool = True) -> Optional[str]:
    """Why a checkpoint directory cannot be loaded, or None: its meta.json and its DCP metadata must be
    readable (the metadata naming only DCP's own types), every data file that metadata names present and
    as long as the data it holds, and (`rank_state`) every rank's state file readable weights-only."""
    if not (checkpoint / META).is_file():
        return f"it has no {META} (a save that did not finish)"
    try:
        meta = read_meta(checkpoint)
        if not isinstance(meta, dict) or not {"step", "world_size", "model"} <= set(meta):
            return f"its {META} lacks step, world_size or model"
    except (OSError, ValueError) as exc:
        return f"its {META} cannot be read: {exc}"
    try:
        metadata = read_dcp_metadata(checkpoint / ".metadata", where=".metadata")
    except PickleRefused as exc:
        return str(exc)
    except Exception as exc:  # a missing or damaged .metadata file, in whichever form it fails
        return f"its DCP metadata cannot be read: {type(exc).__name__}: {str(exc)[:200]}"
    needed: dict[str, int] = {}
    for item in (metadata.storage_data or {}).values():
        needed[item.relative_path] = max(needed.get(item.relative_path, 0), item.offset + item.length)
    for name, size in sorted(needed.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size < size:
            return f"{name} is truncated ({path.stat().st_size:,} of {size:,} bytes)"
    for rank in range(meta["world_size"]) if rank_state and "imported" not in meta else ():  # imports hold none
        try:
            read_rank_state(rank_file(checkpoint, rank))
        except CheckpointError as exc:
            return str(exc)
    return None


def usable_checkpoints(run_dir: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The run's checkpoints that can be loaded, newest first, and those that cannot, with why."""
    root = Path(run_dir) / CHECKPOINTS
    found = [p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(PARTIAL_SUFFIX)] \
        if root.is_dir() else []
    usable, skipped = [], []
    for checkpoint in sorted(found, key=lambda p: p.name, reverse=True):
        problem = checkpoint_problem(checkpoint)
        (skipped.append((checkpoint, problem)) if problem else usable.append(checkpoint))
    return usable, skipped


def resume_candidates(run_dir: Path, resume: Optional[str]) -> tuple[list[Path], list[str]]:
    """The checkpoints to try in turn for `checkpoint.resume`, and a warning for each one passed over.

    'latest': every loadable checkpoint of the run, newest first (none: a fresh start, unless
    checkpoints exist that cannot be loaded: then CheckpointError, never a silent restart that would
    replace them); a path: that checkpoint alone, which must be loadable; None: nothing.
    """
    if resume is None:
        return [], []
    if resume != "latest":
        if Path(resume).is_file():
            raise CheckpointError(f"{resume} is a file, not a checkpoint directory: an open_clip_train checkpoint "
                                  f"(epoch_N.pt) is continued with `fsdpclip import {resume} JOB_FILE`")
        checkpoint = resolve_checkpoint(Path(resume))
        problem = checkpoint_problem(checkpoint)
        if problem:
            raise CheckpointError(f"cannot resume from {checkpoint}: {problem}")
        return [checkpoint], []
    usable, skipped = usable_checkpoints(run_dir)
    warnings = [f"skipping {path}: {why}" for path, why in skipped]
    if not usable and skipped:
        raise CheckpointError(f"{len(skipped)} checkpoint(s) in {Path(run_dir) / CHECKPOINTS} and none can be "
                              f"loaded ({'; '.join(w.removeprefix('skipping ') for w in warnings[:3])}): set "
                              "checkpoint.resume to null to start over (they will be replaced), or to one of them")
    return usable, warnings


def run_job(checkpoint: Path) -> Optional[Job]:
    """The spec of the run that saved `checkpoint` (its run directory's job.json), if it can be read."""
    from fsdpclip.problems import SpecError
    from fsdpclip.spec.jobfile import load_job

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


def publish(partial: Path, final: Path, meta: dict) -> None:
    """Complete a written checkpoint: meta.json last, rename into place, point `latest` at it."""
    write_atomically(partial / META, json.dumps(meta, indent=2))
    if final.exists():
        shutil.rmtree(final)
    partial.rename(final)
    write_atomically(final.parent / LATEST, final.name + "\n")


def save_whole(run_dir: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict) -> Path:
    """Write checkpoint `step` of a model and optimizer that this one process holds whole, without a
    process group: the layout of a sharded save, which any world size resumes (`Checkpointer.load`
    gives each rank its rows); no rank-local state. Returns its path; nothing is left on failure."""
    final = Path(run_dir) / CHECKPOINTS / checkpoint_name(step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        model_state, optim_state = get_state_dict(model, optimizer)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial), no_dist=True)
        publish(partial, final, {**meta, "step": step, "world_size": 1, "saved_at": time.time()})
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return final


class Clock:
    """Seconds between laps, by name."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = round(now - self.last, 3), now


# ------------------------------------------------------------------ staging
DEVICE_HEADROOM = 0.05  # of the device's memory, left free when an asynchronous save's copy is kept there


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _local_tensors(state: dict) -> list[torch.Tensor]:
    """The tensors of a (nested) state dict as this rank holds them: a DTensor's local shard."""
    return [_local(t) for t in tree_flatten(state)[0] if isinstance(t, torch.Tensor)]


def device_bytes(state: dict) -> int:
    """Bytes of this rank's CUDA tensors in a state dict (a DTensor counts its local shard)."""
    return sum(t.nbytes for t in _local_tensors(state) if t.is_cuda)


def spare_device_memory(device: torch.device) -> int:
    """Bytes the caching allocator can still take on `device` without cutting into what training has used:
    the driver's free memory plus what the allocator holds beyond the run's peak, less DEVICE_HEADROOM."""
    free, total = torch.cuda.mem_get_info(device)
    cached = max(0, torch.cuda.memory_reserved(device) - torch.cuda.max_memory_allocated(device))
    return free + cached - int(DEVICE_HEADROOM * total)


def holds(into: dict, state: dict, device: Optional[torch.device] = None) -> bool:
    """Whether `into` has `state`'s layout, each tensor's shape and dtype, on `device` (each its own when None)."""
    leaves, layout = tree_flatten(state)
    kept, kept_layout = tree_flatten(into)
    return kept_layout == layout and all(
        isinstance(k, torch.Tensor) and _local(k).shape == _local(t).shape and k.dtype == t.dtype
        and _local(k).device == (device or _local(t).device)
        for k, t in zip(kept, leaves) if isinstance(t, torch.Tensor))


@torch.no_grad()
def copy_state(state: dict, into: Optional[dict] = None, device: Optional[torch.device] = None) -> dict:
    """A copy of a state dict's tensors on `device` (each on its own when None): copied in place into `into`'s
    tensors when it `holds` the state (no new memory; a copy into page-locked host memory is asynchronous), else
    new ones."""
    if into is None or not holds(into, state, device):
        return tree_map_only(torch.Tensor, lambda t: t.detach().to(device or t.device, copy=True), state)
    leaves, layout = tree_flatten(state)
    kept = tree_flatten(into)[0]
    for kept_tensor, tensor in zip(kept, leaves):
        if isinstance(tensor, torch.Tensor):
            _local(kept_tensor).copy_(_local(tensor), non_blocking=True)
    return tree_unflatten([k if isinstance(t, torch.Tensor) else t for k, t in zip(kept, leaves)], layout)


ALIGN = 64  # bytes: where each tensor carved out of the host copy's memory starts


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def host_copy_bytes(model: nn.Module, trained: list[torch.Tensor]) -> int:
    """The bytes a host copy of `get_state_dict(model, optimizer)` takes on this rank, counted before AdamW has
    state: the model's tensors, and two moments and a step per trained parameter (local shards, each aligned)."""
    model_bytes = sum(_aligned(_local(t).nbytes) for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    return model_bytes + sum(2 * _aligned(_local(p).nbytes) + ALIGN for p in trained) + 2 ** 20


class HostCopy:
    """The host copy of an asynchronous save's state, in page-locked memory, so that copies from the device run at
    the link's speed and leave the host free. Page-locking stalls the process's other CUDA work (about 0.7 s a
    GiB on an H200 host), so the memory is reserved early (`reserve`: on a thread while the run starts) and carved
    into one tensor per state tensor at the first save; every later save copies into the same tensors."""

    def __init__(self):
        self.state: Optional[dict] = None
        self.buffer: Optional[torch.Tensor] = None  # the reserved bytes
        self.locked: list[int] = []  # addresses registered with CUDA, released by `release`
        self.reserving: Optional[threading.Thread] = None

    def reserve(self, nbytes: int) -> None:
        """Allocate `nbytes` on a thread and page-lock them where CUDA is."""
        self.reserving = threading.Thread(target=self._reserve, args=(nbytes,), name="checkpoint-host-memory",
                                          daemon=True)
        self.reserving.start()

    def _reserve(self, nbytes: int) -> None:
        buffer = torch.empty(nbytes, dtype=torch.uint8)
        if torch.cuda.is_available():  # in one piece: a copy may not span two registrations
            self._lock([(buffer.data_ptr(), buffer.data_ptr() + nbytes)])
        self.buffer = buffer

    def copy(self, state: dict) -> dict:
        """`state`'s tensors copied into the host copy (made first when it has another layout); a copy from the
        device is asynchronous on the current stream."""
        host = torch.device("cpu")
        if self.state is None or not holds(self.state, state, host):
            if self.reserving is not None:
                self.reserving.join()
            self.state = self._carve(state)
            if self.state is None:
                self.release()
                self.state = copy_state(state, device=host)
                if any(t.is_cuda for t in _local_tensors(state)):
                    self._lock([(t.data_ptr(), t.data_ptr() + t.nbytes) for t in _local_tensors(self.state)])
                return self.state
        return copy_state(state, self.state, host)

    def _carve(self, state: dict) -> Optional[dict]:
        """Host tensors for `state`'s out of the reserved buffer, with the same DTensor specs; None when the buffer
        is missing or too small (said once)."""
        leaves, layout = tree_flatten(state)
        needed = sum(_aligned(_local(t).nbytes) for t in leaves if isinstance(t, torch.Tensor))
        if self.buffer is None or needed > self.buffer.numel():
            if self.buffer is not None:
                log.warning("asynchronous checkpoints: the state takes %.2f GiB, more than the %.2f GiB reserved for "
                            "its host copy; the copy is made now (training waits for the page-locking)",
                            needed / 2 ** 30, self.buffer.numel() / 2 ** 30)
            return None
        raw, offset, carved = self.buffer.numpy(), 0, []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                carved.append(leaf)
                continue
            local = _local(leaf)
            tensor = torch.frombuffer(raw, dtype=local.dtype, count=local.numel(), offset=offset).view(local.shape) \
                if local.numel() else torch.empty(local.shape, dtype=local.dtype)
            offset += _aligned(local.nbytes)
            # As torch.distributed's own state-dict copies do: DTensor.from_local would move a CPU shard to the mesh's device.
            carved.append(DTensor(tensor, leaf._spec, requires_grad=False) if isinstance(leaf, DTensor) else tensor)
        return tree_unflatten(carved, layout)

    def _lock(self, ranges: list[tuple[int, int]]) -> None:
        """Page-lock address ranges (start, end); where CUDA refuses (a container's limits), copies stay pageable,
        slower."""
        cudart = torch.cuda.cudart()
        for start, end in ranges:
            if end > start and int(cudart.cudaHostRegister(start, end - start, 0)) == 0:
                self.locked.append(start)
        if not self.locked:
            log.warning("asynchronous checkpoints: host memory could not be page-locked; copies to the host are "
                        "slower")

    def release(self) -> None:
        """Let the page-locked memory go (once a reservation under way has ended)."""
        if self.reserving is not None:
            self.reserving.join()
        cudart = torch.cuda.cudart() if self.locked else None
        for address in self.locked:
            cudart.cudaHostUnregister(address)
        self.locked, self.state, self.buffer, self.reserving = [], None, None, None


def write_threads() -> int:
    """Files each rank writes a checkpoint to at once: its share of the node's cores, 1 to 8."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))))


def write_dcp(state: dict, checkpoint_id: str, group=None) -> None:
    """DCP's save of `state` into directory `checkpoint_id`, written by `write_threads()` threads."""
    dcp.save(state, storage_writer=FileSystemWriter(checkpoint_id, thread_count=write_threads()),
             process_group=group)


def write_staged(state: dict, copied: Optional[torch.cuda.Event], host: HostCopy, checkpoint_id: str,
                 group) -> None:
    """The background half of an asynchronous save: a state staged on the device goes into the host copy on a
    stream of its own once `copied` (recorded after the staging copy) is done, then DCP writes it."""
    if copied is not None:
        device = next(t.device for t in _local_tensors(state) if t.is_cuda)
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            stream.wait_event(copied)
            with torch.cuda.stream(stream):
                state = host.copy(state)
            stream.synchronize()
    write_dcp(state, checkpoint_id, group)


class Checkpointer:
    """Saves and loads one run's checkpoints on every rank (rank 0 does the renaming)."""

    def __init__(self, run_dir: Path, spec: CheckpointSpec, rank: int, world_size: int):
        self.root = Path(run_dir) / CHECKPOINTS
        self.spec, self.rank, self.world_size = spec, rank, world_size
        self.pending: Optional[tuple] = None  # (future, partial dir, final dir, meta, bytes needed)
        self.async_group, self.writer = None, None  # made at the first asynchronous save
        self.staging: Optional[str] = None  # where asynchronous saves copy the state: "device" or "host"
        self.snapshot: Optional[dict] = None  # the device copy, reused by every asynchronous save
        self.host = HostCopy()  # the host copy, likewise
        self.phases: dict[str, float] = {}  # seconds of the last save's parts that training waited for
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*" + PARTIAL_SUFFIX):  # left by a crash while saving
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # ------------------------------------------------------------------- saving
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
             rank_state: dict, asynchronous: bool = False) -> Path:
        """Write checkpoint `step` (every rank calls it); returns its final path. `self.phases` says what
        training waited for: the write before, the state dict, the space check and the copy or write."""
        clock = Clock()
        self.finish_pending(wait=True)
        clock.lap("wait")
        final = self.root / checkpoint_name(step)
        partial = self.root / (final.name + PARTIAL_SUFFIX)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        clock.lap("state_dict")
        needed = self._check_space(final, state)
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        dist.barrier()
        clock.lap("space")
        meta = {**meta, "step": step, "world_size": self.world_size, "saved_at": time.time()}
        with self._failure_named(final, needed):
            self._write_rank_state(partial, rank_state)
            if asynchronous:
                self.pending = (self._save_in_background(state, str(partial)), partial, final, meta, needed)
            else:
                write_dcp(state, str(partial))
                self._finalize(partial, final, meta)
                dist.barrier()
        clock.lap("stage" if asynchronous else "write")
        self.phases = clock.laps
        return final

    @contextlib.contextmanager
    def _failure_named(self, final: Path, needed: int):
        """A write of checkpoint `final` that fails is a CheckpointError naming the first failure; DiskFull while
        its disk has less than `needed` free (the disk filled while writing: torch.save says only 'unexpected
        pos', DCP a CheckpointException, which is a BaseException)."""
        try:
            yield
        except (Exception, CheckpointException) as exc:
            free = disk_free(self.root)
            if free < needed:
                raise DiskFull(no_space_message(final, free, needed)) from exc
            raise CheckpointError(f"checkpoint {final.name} could not be written: {_first_failure(exc)}") from exc

    def _check_space(self, final: Path, state: dict) -> int:
        """The bytes checkpoint `final` will take (every rank's shards, and a margin for the rank and metadata
        files); DiskFull on every rank, before anything is written, when rank 0 finds less free on its disk."""
        local = sum(tensor.nbytes for tensor in _local_tensors(state))
        found = [None] * self.world_size
        dist.all_gather_object(found, (local, disk_free(self.root) if self.rank == 0 else 0))
        needed = int(sum(size for size, _ in found) * 1.01) + self.world_size * 2 ** 16 + 2 ** 20
        free = found[0][1]
        if needed > free:
            raise DiskFull(no_space_message(final, free, needed))
        return needed

    def _save_in_background(self, state: dict, checkpoint_id: str) -> Future:
        """Copy `state` where training no longer changes it (`self.staging`, settled at the first
        asynchronous save), then write it from a background thread; returns the write's future."""
        if self.async_group is None:
            self.async_group = dist.new_group(backend="gloo")
            self.writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-writer")
        device = next((_local(t).device for t in tree_flatten(state)[0]
                       if isinstance(t, torch.Tensor) and t.is_cuda), None)
        if self.staging is None:
            self.staging = self._staging_place(state, device)
        copied = None
        if self.staging == "device":
            self.snapshot = state = copy_state(state, self.snapshot)
            copied = torch.cuda.Event()
            copied.record()
        else:
            state = self.host.copy(state)
            if device is not None:
                torch.cuda.current_stream(device).synchronize()
        return self.writer.submit(write_staged, state, copied, self.host, checkpoint_id, self.async_group)

    def _staging_place(self, state: dict, device: Optional[torch.device]) -> str:
        """"device" when the state's device tensors fit in the device's spare memory, else "host" (said once)."""
        if device is None:
            return "host"
        needed, spare = device_bytes(state), spare_device_memory(device)
        if needed <= spare:
            log.info("asynchronous checkpoints are copied in device memory (%.1f GiB of %.1f GiB spare); the copy "
                     "to the host and the writes go on in the background", needed / 2 ** 30, spare / 2 ** 30)
            return "device"
        log.warning("asynchronous checkpoints are copied to the host before training goes on: the copy needs "
                    "%.1f GiB of device memory, %.1f GiB are spare", needed / 2 ** 30, max(0, spare) / 2 ** 30)
        return "host"

    def _write_rank_state(self, partial: Path, rank_state: dict) -> None:
        torch.save(rank_state, rank_file(partial, self.rank))

    def write_status(self) -> int:
        """This rank's asynchronous write: IDLE (none, or done and fine), WRITING or FAILED; the ranks agree on
        the largest before acting on it, since each sees its write end at its own step."""
        if self.pending is None or (self.pending[0].done() and self.pending[0].exception() is None):
            return IDLE
        return WRITING if not self.pending[0].done() else FAILED

    def finish_pending(self, wait: bool) -> None:
        """Complete an asynchronous save once its writes are done (or wait for them). Without waiting, a write
        that failed stays pending: it is raised once the ranks agree on it (`write_status`), or by a wait."""
        if self.pending is None:
            return
        future, partial, final, meta, needed = self.pending
        if not wait and (not future.done() or future.exception() is not None):
            return
        self.pending = None  # a failed write is reported once; its partial directory is never published
        with self._failure_named(final, needed):
            future.result()
        self._finalize(partial, final, meta)

    def close(self) -> None:
        """Let go of the host copy's page-locked memory, unless a write may still be copying into it."""
        if self.pending is None or self.pending[0].done():
            self.host.release()

    def _finalize(self, partial: Path, final: Path, meta: dict) -> None:
        """Rank 0: publish the checkpoint (`publish`), drop old ones."""
        if self.rank != 0:
            return
        publish(partial, final, meta)
        for old in complete_checkpoints(self.root.parent)[:-self.spec.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def resume_candidates(self) -> list[Path]:
        """What the spec says to resume from, newest first (`resume_candidates`); logs what is skipped.

        Rank 0 decides and every rank follows: ranks looking on their own could see different
        checkpoints on a shared filesystem whose caches lag."""
        chosen = [([], [], None)]  # (candidates, warnings, why none can be used)
        if self.rank == 0:
            try:
                chosen[0] = (*resume_candidates(self.root.parent, self.spec.resume), None)
            except CheckpointError as exc:
                chosen[0] = ([], [], str(exc))
        dist.broadcast_object_list(chosen, src=0)
        candidates, warnings, error = chosen[0]
        if error is not None:
            raise CheckpointError(error)
        for warning in warnings if self.rank == 0 else []:
            log.warning("%s", warning)
        return candidates

    def load(self, checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, Optional[dict]]:
        """Load model and optimizer (resharded to this world size); (meta, this rank's state or None).

        Rank-local state comes back only when the world size is the one that saved it. A checkpoint
        that cannot be read (its rank state on any rank; what DCP reads, DCP reports to all) is a
        CheckpointError on every rank, before anything is loaded into the model.
        """
        meta = read_meta(checkpoint)
        same_world = meta["world_size"] == self.world_size and "imported" not in meta
        rank_state = self._read_rank_state(checkpoint) if same_world else None
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, storage_reader=SafeReader(str(checkpoint)), planner=SafeLoadPlanner())
        except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
            raise CheckpointError(f"{checkpoint} cannot be read: {_first_failure(exc)}") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return meta, rank_state

    def _read_rank_state(self, checkpoint: Path) -> dict:
        """This rank's saved state; CheckpointError on every rank when any rank cannot read its own."""
        state, problem = None, None
        try:
            state = read_rank_state(rank_file(checkpoint, self.rank))
        except CheckpointError as exc:
            problem = str(exc)
        problems = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p is not None), None)
        if first is not None:
            raise CheckpointError(f"{checkpoint} cannot be read: {first}")
        return state


# ----------------------------------------------------------------------- export
def read_model_state(checkpoint: Path, model: nn.Module) -> dict[str, torch.Tensor]:
    """The full model state of a sharded checkpoint, read by this process alone onto the CPU.

    `model` (usually on the meta device) gives the keys, shapes and dtypes.
    """
    problem = checkpoint_problem(checkpoint, rank_state=False)
    if problem:
        raise CheckpointError(f"{checkpoint} cannot be read: {problem}")
    state = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": state}, storage_reader=SafeReader(str(checkpoint)), planner=SafeLoadPlanner(),
                     no_dist=True)
    except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
        raise CheckpointError(f"{checkpoint} cannot be read: {_first_failure(exc)}") from None
    except Exception as exc:  # DCP reports a mismatch in many forms
        raise CheckpointError(f"{checkpoint} does not match the model: {str(exc).strip()[:300]}") from None
    return state


def _first_failure(exc: BaseException) -> str:
    """The first rank's error out of a CheckpointException, on one line."""
    failures = getattr(exc, "failures", None) or {}
    first = next(iter(failures.values()), exc)
    error = first[0] if isinstance(first, tuple) else first
    return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def export_checkpoint(checkpoint: Path, model: nn.Module, out: Path, config: dict, safetensors: bool = False) -> Path:
    """Write the model of a sharded checkpoint as one OpenCLIP checkpoint, in one process.

    `out` is a file (`.pt`, `.bin`, `.safetensors`) or a directory laid out for open_clip's
    `local-dir:` (open_clip_config.json beside the weights). `model` is the unwrapped model on
    the meta device: its full state is allocated once on the CPU, filled from the checkpoint
    and written from the same tensors. Returns the weights file written. The destination is made
    (and so checked) before anything is read; OSError when it cannot be.
    """
    from fsdpclip.model.build import SHARED_PARAMETERS

    out = Path(out)
    safetensors = safetensors or out.suffix == ".safetensors"
    folder = out.suffix not in (".pt", ".bin", ".pth", ".safetensors")
    (out if folder else out.parent).mkdir(parents=True, exist_ok=True)
    weights = out / ("open_clip_model.safetensors" if safetensors else "open_clip_pytorch_model.bin") if folder else out
    partial = weights.with_name(weights.name + PARTIAL_SUFFIX)
    partial.touch()
    try:
        state = read_model_state(checkpoint, model)
        for name in SHARED_PARAMETERS:  # OpenCLIP keeps them 0-d
            if name in state:
                state[name] = state[name].reshape(())
        if folder:
            write_atomically(out / "open_clip_config.json", json.dumps(
                {"model_cfg": config, "preprocess_cfg": model.visual.preprocess_cfg}, indent=2))
        if safetensors:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in state.items()}, str(partial))
        else:
            torch.save({"state_dict": state}, partial)
        partial.replace(weights)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return weights
