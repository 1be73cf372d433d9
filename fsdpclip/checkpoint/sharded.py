"""Sharded checkpoints saved and loaded by every rank of a run (`Checkpointer`): their layout in
`fsdpclip.checkpoint.layout`, the asynchronous saves' copies in `fsdpclip.checkpoint.staging`, their copies in
object storage in `fsdpclip.checkpoint.remote`.
"""

from __future__ import annotations

import contextlib
import logging
import random
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils._pytree import tree_flatten

from fsdpclip.checkpoint.layout import (
    AVERAGES, CHECKPOINTS, PARTIAL_SUFFIX, CheckpointError, DiskFull, averaged_names, checkpoint_name,
    complete_checkpoints, first_failure, publish, rank_file, read_meta, read_rank_state, resume_candidates,
)
from fsdpclip.model.pickles import SafeLoadPlanner, SafeReader
from fsdpclip.checkpoint.remote import RemoteFolder, Uploads, fetch_resume
from fsdpclip.checkpoint.staging import (
    HostCopy, copy_state, device_bytes, local_shard, local_tensors, spare_device_memory, write_dcp, write_staged,
)
from fsdpclip.model.float8 import without_float8_wrappers
from fsdpclip.run.files import disk_free, no_space_message
from fsdpclip.jobspec.job import CheckpointSpec


log = logging.getLogger("fsdpclip.checkpoint.sharded")
IDLE, WRITING, FAILED = 0, 1, 2  # an asynchronous write's status (`Checkpointer.write_status`)


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


class Clock:
    """Seconds between laps, by name."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = round(now - self.last, 3), now


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
        self.uploads = Uploads(RemoteFolder(spec.remote, spec.remote_options), spec.keep) \
            if spec.remote is not None and rank == 0 else None  # checkpoint.remote: rank 0 uploads
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob("*" + PARTIAL_SUFFIX):  # left by a crash while saving
                shutil.rmtree(stale, ignore_errors=True)
        dist.barrier()

    # ------------------------------------------------------------------- saving
    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, meta: dict,
             rank_state: dict, asynchronous: bool = False, averages: Optional[dict] = None) -> Path:
        """Write checkpoint `step` (every rank calls it), with the moving average's `averages` where given;
        returns its final path. `self.phases` says what training waited for: the write before, the state dict,
        the space check and the copy or write."""
        clock = Clock()
        self.finish_pending(wait=True)
        clock.lap("wait")
        final = self.root / checkpoint_name(step)
        partial = self.root / (final.name + PARTIAL_SUFFIX)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = without_float8_wrappers(
            {"model": model_state, "optim": optim_state, **({AVERAGES: averages} if averages is not None else {})})
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
            raise CheckpointError(f"checkpoint {final.name} could not be written: {first_failure(exc)}") from exc

    def _check_space(self, final: Path, state: dict) -> int:
        """The bytes checkpoint `final` will take (every rank's shards, and a margin for the rank and metadata
        files); DiskFull on every rank, before anything is written, when rank 0 finds less free on its disk."""
        local = sum(tensor.nbytes for tensor in local_tensors(state))
        found: list = [None] * self.world_size
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
        device = next((local_shard(t).device for t in tree_flatten(state)[0]
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
        assert self.writer is not None  # made with the group, above
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

    def finish_uploads(self) -> Optional[str]:
        """Rank 0: wait for the uploads under way (checkpoint.remote), then drop the local checkpoints they
        spared; why the last one failed, or None."""
        if self.uploads is None:
            return None
        failure = self.uploads.wait()
        self._drop_old()
        return failure

    def close(self) -> None:
        """Let go of the host copy's page-locked memory, unless a write may still be copying into it; drop the
        uploads not begun."""
        if self.pending is None or self.pending[0].done():
            self.host.release()
        if self.uploads is not None:
            self.uploads.close()

    def _finalize(self, partial: Path, final: Path, meta: dict) -> None:
        """Rank 0: publish the checkpoint (`publish`), upload it (checkpoint.remote), drop old ones."""
        if self.rank != 0:
            return
        publish(partial, final, meta)
        if self.uploads is not None:
            self.uploads.submit(final)
        self._drop_old()

    def _drop_old(self) -> None:
        """Delete the complete checkpoints before the newest `keep`, but those still to be uploaded."""
        uploading = self.uploads.uploading() if self.uploads is not None else set()
        for old in complete_checkpoints(self.root.parent)[:-self.spec.keep]:
            if old not in uploading:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def resume_candidates(self) -> list[Path]:
        """What the spec says to resume from, newest first (`resume_candidates`); logs what is skipped.

        Rank 0 decides and every rank follows: ranks looking on their own could see different
        checkpoints on a shared filesystem whose caches lag. Rank 0 first downloads what object storage holds
        for the resume (`fetch_resume`); the other ranks wait for it within the collective timeout."""
        # (candidates, warnings, why none can be used)
        chosen: list[tuple[list, list, Optional[str]]] = [([], [], None)]
        if self.rank == 0:
            try:
                chosen[0] = (*resume_candidates(self.root.parent, fetch_resume(self.root.parent, self.spec)), None)
            except CheckpointError as exc:
                chosen[0] = ([], [], str(exc))
        dist.broadcast_object_list(chosen, src=0)
        candidates, warnings, error = chosen[0]
        if error is not None:
            raise CheckpointError(error)
        for warning in warnings if self.rank == 0 else []:
            log.warning("%s", warning)
        return candidates

    def load(self, checkpoint: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
             averages: Optional[dict] = None) -> tuple[dict, Optional[dict], bool]:
        """Load model and optimizer (resharded to this world size), and the moving average into `averages` where
        given and the checkpoint holds one; (meta, this rank's state or None, whether it holds one).

        Rank-local state comes back only when the world size is the one that saved it. A checkpoint
        that cannot be read (its rank state on any rank; what DCP reads, DCP reports to all) is a
        CheckpointError on every rank, before anything is loaded into the model.
        """
        meta = read_meta(checkpoint)
        same_world = meta["world_size"] == self.world_size and "imported" not in meta
        rank_state = self.read_rank_states(checkpoint, [self.rank])[0] if same_world else None
        averaged = bool(averaged_names(checkpoint))
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state,
                 **({AVERAGES: averages} if averages is not None and averaged else {})}
        try:
            dcp.load(state, storage_reader=SafeReader(str(checkpoint)), planner=SafeLoadPlanner())  # pyright: ignore[reportPrivateImportUsage]  (torch re-exports it without __all__)
        except CheckpointException as exc:  # a BaseException: `except Exception` would miss it
            raise CheckpointError(f"{checkpoint} cannot be read: {first_failure(exc)}") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return meta, rank_state, averaged

    def read_rank_states(self, checkpoint: Path, ranks: list[int]) -> list[dict]:
        """The saved states of `ranks` (of the world that saved `checkpoint`: this rank's own, or those whose data
        it goes on reading); CheckpointError on every rank when any rank cannot read one of its own."""
        states, problem = [], None
        try:
            states = [read_rank_state(rank_file(checkpoint, rank)) for rank in ranks]
        except CheckpointError as exc:
            problem = str(exc)
        problems: list[Optional[str]] = [None] * self.world_size
        dist.all_gather_object(problems, problem)
        first = next((p for p in problems if p is not None), None)
        if first is not None:
            raise CheckpointError(f"{checkpoint} cannot be read: {first}")
        return states
