"""The GPU's hardware JPEG engines (nvImageCodec's `HW_GPU_ONLY` backend) taking a share of the JPEGs of
`data.decode` 'mixed' off the data workers, and the share itself.

The engines are fixed-function units beside the GPU's multiprocessors: they decode while a training step
keeps the multiprocessors busy, where nvJPEG's CUDA decode and a second process on the GPU do not
(docs/performance.md, "Data on real shards"). The rank decodes the share's JPEGs on the DataLoader's pinning
thread, ahead of the step; the workers decode and crop the rest. Which samples go to the engines is drawn
from each sample's augmentation seed against the share, a float in shared memory that the rank moves after
the step's waits for its batches (`EngineShare`). On the CPU (tests) nvImageCodec's CPU decoder stands in.
A process that holds a decoder starts its DataLoader workers from a fork server (`worker_context`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import random
import signal
import tempfile
import threading
from typing import Any, Optional

import torch

log = logging.getLogger("fsdpclip.data.engines")
INSTALL = "pip install 'fsdpclip[nvimgcodec]'"
REFUSED_IN_A_ROW = 3  # batches in a row of which the engines decoded nothing: then they decode no more
_SALT = 0x5DEECE66D  # the engines' draw is a stream of its own, not the augmentation's first draw


def installed() -> bool:
    """Whether nvImageCodec is installed, asked without importing it: its import initialises the CUDA driver,
    after which no process forked from this one can use CUDA (the launcher, whose ranks are its forks)."""
    try:
        return importlib.util.find_spec("nvidia.nvimgcodec") is not None
    except (ImportError, ValueError):  # no `nvidia` package at all (its parent is imported to look)
        return False


def missing() -> Optional[str]:
    """Why the engines cannot be used here (nvImageCodec not importable), or None. Imports nvImageCodec (a rank
    calls it on its main thread, before any decoder is made: `_nvimgcodec`)."""
    try:
        _nvimgcodec()
    except ImportError as exc:
        return (f"nvImageCodec did not import ({exc.msg})" if installed() else
                f"nvImageCodec is not installed ({exc.msg})") + f": {INSTALL}"
    return None


def engines_on(requested, device_type: str) -> bool:
    """Whether the engines take a share of the JPEGs: `data.jpeg_engines` with 'auto' settled as on CUDA
    where nvImageCodec is installed (True asks for them anywhere; nvImageCodec's CPU decoder on the CPU).
    Imports nothing (`installed`)."""
    if requested == "auto":
        return device_type == "cuda" and installed()
    return bool(requested)


def _nvimgcodec() -> Any:  # an extension module without type information
    """nvImageCodec, imported with what its extension loader prints about codecs fsdpclip does not use (JPEG
    2000, TIFF: 'Failed to load nvjpeg2k library!') kept off the console, in the log at debug level. Called on
    the main thread before any decoder is made (`missing`), so no other thread's output is caught with it."""
    import sys

    if "nvidia.nvimgcodec" in sys.modules:
        return sys.modules["nvidia.nvimgcodec"]
    sys.stdout.flush()
    sys.stderr.flush()
    with tempfile.TemporaryFile() as said:
        kept = [os.dup(1), os.dup(2)]
        try:
            os.dup2(said.fileno(), 1)
            os.dup2(said.fileno(), 2)
            from nvidia import nvimgcodec
        finally:
            os.dup2(kept[0], 1)
            os.dup2(kept[1], 2)
            for fd in kept:
                os.close(fd)
            said.seek(0)
            if text := said.read().decode(errors="replace").strip():
                log.debug("nvImageCodec on import: %s", text)
    return nvimgcodec


class _Decoder:
    """One device's nvImageCodec decoder and the images it decodes into, reused batch after batch so that
    the engines' output memory is allocated once. The images are copied out before the next decode may
    write them (`decode`, under the lock)."""

    def __init__(self, device: torch.device):
        nv = _nvimgcodec()
        self.nv, self.device = nv, device
        if device.type == "cuda":
            self.decoder = nv.Decoder(device_id=device.index, backends=[nv.Backend(nv.BackendKind.HW_GPU_ONLY)])
        else:
            self.decoder = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY,
                                      backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
        self.params = nv.DecodeParams(apply_exif_orientation=False, color_spec=nv.ColorSpec.SRGB,
                                      sample_format=nv.SampleFormat.I_RGB)  # as PIL and torchvision: no EXIF turn
        self.images: list = []

    def decode(self, jpegs: list[torch.Tensor]) -> list[Optional[torch.Tensor]]:
        """Each JPEG (uint8 bytes on the host) as uint8 (3, H, W) on the device, a copy of its own (on the
        current stream), or None where the engines could not decode it."""
        streams = [self.nv.CodeStream(jpeg.numpy()) for jpeg in jpegs]
        stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
        reused, decoded = self.images[:len(streams)], None
        if len(reused) == len(streams) and all(image is not None for image in reused):
            try:
                decoded = self.decoder.decode(streams, images=reused, params=self.params, cuda_stream=stream)
            except RuntimeError as exc:  # then fresh images, from here on
                log.debug("nvImageCodec did not decode into its earlier images (%s)", exc)
                self.images = []
        if decoded is None:
            decoded = self.decoder.decode(streams, params=self.params, cuda_stream=stream)
        self.images[:len(decoded)] = decoded
        return [None if image is None else self._tensor(image).permute(2, 0, 1).clone() for image in decoded]

    def _tensor(self, image) -> torch.Tensor:
        """A decoded image (H, W, 3) as a tensor on the device, sharing its memory."""
        if self.device.type == "cuda":
            return torch.as_tensor(image, device=self.device)  # its __cuda_array_interface__
        import numpy as np

        return torch.from_numpy(np.asarray(image))


_DECODERS: dict[torch.device, _Decoder] = {}
_LOCK = threading.Lock()  # one decode at a time per process: the pinning threads of two loaders share a decoder
_refused: list[str] = []  # why the engines decode no more (set once; `EngineShare` reads it)
_failed_in_a_row = 0


def decode(jpegs: list[torch.Tensor], device: torch.device) -> list[Optional[torch.Tensor]]:
    """The JPEGs decoded on `device`'s hardware engines (nvImageCodec's CPU decoder on the CPU): uint8 (3, H, W)
    each, None for one they could not decode (the caller decodes it otherwise). Where no decoder can be made
    here, or REFUSED_IN_A_ROW batches in a row come back with nothing decoded, `EngineShare` sends no more."""
    global _failed_in_a_row
    with _LOCK:
        try:
            if device not in _DECODERS:
                _DECODERS[device] = _Decoder(device)
        except Exception as exc:  # no engines on this GPU, a driver too old
            _refused[:] = _refused or [f"{type(exc).__name__}: {exc}"]
            return [None] * len(jpegs)
        try:
            decoded: list[Optional[torch.Tensor]] = _DECODERS[device].decode(jpegs)
        except Exception as exc:  # one bad batch, or out of memory: these JPEGs go the other way
            log.warning("the JPEG engines could not decode a batch (%s: %s)", type(exc).__name__, exc)
            decoded = [None] * len(jpegs)
        _failed_in_a_row = _failed_in_a_row + 1 if jpegs and all(image is None for image in decoded) else 0
        if _failed_in_a_row >= REFUSED_IN_A_ROW and not _refused:
            _refused.append(f"{REFUSED_IN_A_ROW} batches in a row decoded nothing on {device}")
        return decoded


def to_engines(seed: int, share: float) -> bool:
    """Whether the sample of augmentation seed `seed` goes to the engines at `share`: a draw of its own from the
    seed, so that a share gives the same split on every run and a larger share keeps the smaller's samples."""
    return share > 0 and random.Random(seed ^ _SALT).random() < share


def worker_context(engines: bool = False):
    """How this process starts its DataLoader workers: forked (None), unless it holds the engines' decoder or
    will (`engines`): then from a fork server, started here with the stop signals blocked (the server and the
    resource tracker keep them blocked, so a signal to the job's process group reaches the rank alone), whose
    fork is safe where a fork of this process, with the decoder's threads mid-work, is not."""
    if not (engines or _DECODERS):
        return None
    import multiprocessing
    from multiprocessing import forkserver, resource_tracker

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fsdpclip.data.forkserver"])
    kept = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})
    try:
        forkserver.ensure_running()
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, kept)
    return context


class EngineShare:
    """The share of JPEGs the data workers leave to the engines: one float in shared memory, which every
    worker reads per sample and the rank sets, in steps of STEP from START. After each window of micro batches
    (longer than the batches the workers hold ahead, so that a window sees the share it judges) it is judged by
    the step's wait for its batches (the trainer's measure: the device idle for them, whether the workers or
    the engines were late): raised while the step waited over WAITING of the window; lowered where the last
    raise made the wait longer (the engines set the pace), and then not raised past that for EXPIRES windows;
    held otherwise."""

    START, STEP, MOST, WAITING, EXPIRES = 6, 0.05, 18, 0.03, 10  # START and MOST in steps: 0.3, 0.9

    def __init__(self, window: int):
        self.value = torch.full((1,), self.START * self.STEP).share_memory_()
        self.level, self.window = self.START, window
        self.batches, self.waited, self.elapsed = 0, 0.0, 0.0
        self.last: Optional[float] = None  # the previous window's wait fraction
        self.raised = False  # the last window raised the share
        self.most, self.capped_for = self.MOST, 0  # a lowered ceiling, and for how many more windows

    @property
    def share(self) -> float:
        return self.level * self.STEP

    def observe(self, waited: float, elapsed: float, batches: int) -> None:
        """The step waited `waited` of `elapsed` seconds for its last `batches` micro batches."""
        if _refused:
            return self.stop(_refused[0])
        self.batches, self.waited, self.elapsed = self.batches + batches, self.waited + waited, self.elapsed + elapsed
        if self.batches < self.window:
            return
        fraction = self.waited / max(self.elapsed, 1e-9)
        level = self.level
        if fraction > self.WAITING and self.raised and self.last is not None and fraction > self.last + self.WAITING:
            level -= 1
            self.most, self.capped_for = level, self.EXPIRES
        elif fraction > self.WAITING:
            level = min(self.most, level + 1)
        self.raised, self.level = level > self.level, max(0, level)
        self.value[0] = self.share
        self.capped_for = max(0, self.capped_for - 1)
        if not self.capped_for:
            self.most = self.MOST
        self.last, self.batches, self.waited, self.elapsed = fraction, 0, 0.0, 0.0

    def stop(self, reason: str) -> None:
        """No more JPEGs to the engines (they decode none here)."""
        if self.level:
            log.warning("data: the GPU's JPEG engines decode no JPEGs here (%s): the data workers decode every "
                        "JPEG from here on", reason)
        self.level, self.value[0] = 0, 0.0
