"""Where an asynchronous save's state waits while training goes on, and how it is written.

The state is copied into spare device memory when the device has it (a device-to-device copy: training
waits milliseconds), then into the host copy (`HostCopy`: page-locked memory reserved while the run
starts) and written by DCP from a background thread (`write_staged`); without that device memory it is
copied into the host copy first (training waits for that copy).
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from fsdpclip.run.node import cores_per_local_rank, host_memory

log = logging.getLogger("fsdpclip.checkpoint.staging")
DEVICE_HEADROOM = 0.05  # of the device's memory, left free when an asynchronous save's copy is kept there


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_tensors(state: dict) -> list[torch.Tensor]:
    """The tensors of a (nested) state dict as this rank holds them: a DTensor's local shard."""
    return [local_shard(t) for t in tree_flatten(state)[0] if isinstance(t, torch.Tensor)]


def device_bytes(state: dict) -> int:
    """Bytes of this rank's CUDA tensors in a state dict (a DTensor counts its local shard)."""
    return sum(t.nbytes for t in local_tensors(state) if t.is_cuda)


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
        isinstance(k, torch.Tensor) and local_shard(k).shape == local_shard(t).shape and k.dtype == t.dtype
        and local_shard(k).device == (device or local_shard(t).device)
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
            local_shard(kept_tensor).copy_(local_shard(tensor), non_blocking=True)
    return tree_unflatten([k if isinstance(t, torch.Tensor) else t for k, t in zip(kept, leaves)], layout)


ALIGN = 64  # bytes: where each tensor carved out of the host copy's memory starts


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def host_copy_bytes(model: nn.Module, trained: list[torch.Tensor], averages: Optional[dict] = None) -> int:
    """The bytes a host copy of `get_state_dict(model, optimizer)` takes on this rank, counted before AdamW has
    state: the model's tensors, two moments and a step per trained parameter, and the moving average's
    `averages` where the checkpoint holds them too (local shards, each aligned)."""
    model_bytes = sum(_aligned(local_shard(t).nbytes) for t in model.state_dict().values()
                      if isinstance(t, torch.Tensor))
    average_bytes = sum(_aligned(t.nbytes) for t in local_tensors(averages or {}))
    return model_bytes + sum(2 * _aligned(local_shard(p).nbytes) + ALIGN for p in trained) + average_bytes + 2 ** 20


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
        try:
            buffer = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:  # the host has no room: said here, not lost with the thread
            log.warning("asynchronous checkpoints: %.1f GiB for the host copy could not be reserved (%s); each "
                        "save makes its copy, and training waits while the first one is page-locked",
                        nbytes / 2 ** 30, str(exc).splitlines()[0])
            return
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
                if any(t.is_cuda for t in local_tensors(state)):
                    self._lock([(t.data_ptr(), t.data_ptr() + t.nbytes) for t in local_tensors(self.state)])
                return self.state
        return copy_state(state, self.state, host)

    def _carve(self, state: dict) -> Optional[dict]:
        """Host tensors for `state`'s out of the reserved buffer, with the same DTensor specs; None when the buffer
        is missing or too small (said once)."""
        leaves, layout = tree_flatten(state)
        needed = sum(_aligned(local_shard(t).nbytes) for t in leaves if isinstance(t, torch.Tensor))
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
            local = local_shard(leaf)
            tensor = torch.frombuffer(raw, dtype=local.dtype, count=local.numel(), offset=offset).view(local.shape) \
                if local.numel() else torch.empty(local.shape, dtype=local.dtype)
            offset += _aligned(local.nbytes)
            # As torch.distributed's own state-dict copies do: DTensor.from_local would move a CPU shard to the
            # mesh's device.
            carved.append(DTensor(tensor, leaf._spec, requires_grad=False) if isinstance(leaf, DTensor) else tensor)
        return tree_unflatten(carved, layout)

    def _lock(self, ranges: list[tuple[int, int]]) -> None:
        """Page-lock address ranges (start, end); where CUDA refuses (a container's limits), copies stay pageable,
        slower."""
        cudart = torch.cuda.cudart()
        for start, end in ranges:
            if end > start and int(cudart.cudaHostRegister(start, end - start, 0)) == 0:  # pyright: ignore[reportOptionalMemberAccess]  (set once CUDA is initialised)
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
            cudart.cudaHostUnregister(address)  # pyright: ignore[reportOptionalMemberAccess]  (set once CUDA is initialised)
        self.locked, self.state, self.buffer, self.reserving = [], None, None, None


HOST_SHARE = 0.25  # of a node's memory that 'auto' lets the host copies of its ranks take


def asynchronous_saves(setting, device_type: str, host_bytes: int, local_ranks: int) -> bool:
    """checkpoint.async_save resolved: 'auto' is on for CUDA devices when the host copies of a node's ranks
    (`host_bytes` each) take at most HOST_SHARE of its memory (elsewhere the state already lives on the host, and
    a save is a write)."""
    if setting != "auto":
        return setting
    return device_type == "cuda" and host_bytes * local_ranks <= HOST_SHARE * host_memory()


def write_threads() -> int:
    """Files each rank writes a checkpoint to at once: its share of the node's cores, 1 to 8."""
    return min(8, cores_per_local_rank())


DCP_WRITER_THREAD = "(_write_files_from_queue)"  # how Python names the threads FileSystemWriter starts


class JoinedWriter(FileSystemWriter):
    """DCP's FileSystemWriter, whose own threads have all ended when a write returns or fails. DCP leaves them
    running when the write of its calling thread fails (a full disk), and prints a thread's failure on the
    terminal after the save's error was reported; a thread that failed alone left its files out of the
    checkpoint's metadata. Here the first failure fails the write, and no thread prints a traceback."""

    def write_data(self, plan, planner):
        started, failures, report = set(threading.enumerate()), [], threading.excepthook

        def keep_failure(args) -> None:
            if args.thread not in started and args.thread.name.endswith(DCP_WRITER_THREAD):
                failures.append(args.exc_value)
            else:
                report(args)

        threading.excepthook = keep_failure
        try:
            written = super().write_data(plan, planner)
        finally:
            for thread in set(threading.enumerate()) - started:
                if thread.name.endswith(DCP_WRITER_THREAD):
                    thread.join()
            threading.excepthook = report
        if failures:
            raise failures[0]
        return written


def write_dcp(state: dict, checkpoint_id: str, group=None) -> None:
    """DCP's save of `state` into directory `checkpoint_id`, written by `write_threads()` threads."""
    dcp.save(state, storage_writer=JoinedWriter(checkpoint_id, thread_count=write_threads()),  # pyright: ignore[reportPrivateImportUsage]
             process_group=group)  # (torch re-exports dcp.save without __all__)


def write_staged(state: dict, copied: Optional[torch.cuda.Event], host: HostCopy, checkpoint_id: str,
                 group) -> None:
    """The background half of an asynchronous save: a state staged on the device goes into the host copy on a
    stream of its own once `copied` (recorded after the staging copy) is done, then DCP writes it."""
    if copied is not None:
        device = next(t.device for t in local_tensors(state) if t.is_cuda)
        with torch.cuda.device(device):
            stream = torch.cuda.Stream()
            stream.wait_event(copied)
            with torch.cuda.stream(stream):
                state = host.copy(state)
            stream.synchronize()
    write_dcp(state, checkpoint_id, group)
