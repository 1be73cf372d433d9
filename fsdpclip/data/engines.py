"""The GPU's hardware JPEG engines (nvImageCodec's `HW_GPU_ONLY` backend) taking a share of the JPEGs of
`data.decode` 'mixed' off the data workers, and the share itself.

The engines are fixed-function units beside the GPU's multiprocessors: they decode while a training step
keeps the multiprocessors busy, where nvJPEG's CUDA decode and a second process on the GPU do not
(docs/performance.md, "Data on real shards"). The rank decodes the share's JPEGs on the DataLoader's pinning
thread, ahead of the step; the workers decode and crop the rest. Which samples go to the engines is drawn
from each sample's augmentation seed against the share, a float in shared memory that the rank raises while
the step waits for its batches (`EngineShare`). On the CPU (tests) nvImageCodec's CPU decoder stands in.
"""

from __future__ import annotations

import logging
import os
import random
import tempfile
import threading
from typing import Optional

import torch

log = logging.getLogger("fsdpclip.data.engines")
INSTALL = "pip install 'fsdpclip[nvimgcodec]'"


def missing() -> Optional[str]:
    """Why the engines cannot be used here (nvImageCodec not importable), or None."""
    try:
        _nvimgcodec()
    except ImportError as exc:
        return f"nvImageCodec is not installed ({exc.msg}): {INSTALL}"
    return None


def _nvimgcodec():
    """nvImageCodec, imported with what its extension loader prints about codecs fsdpclip does not use (JPEG
    2000, TIFF: 'Failed to load nvjpeg2k library!') kept off the console, in the log at debug level."""
    import sys

    if "nvidia.nvimgcodec" in sys.modules:
        return sys.modules["nvidia.nvimgcodec"]
    sys.stdout.flush()
    sys.stderr.flush()
    kept = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as said:
        os.dup2(said.fileno(), 1)
        os.dup2(said.fileno(), 2)
        try:
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


def engines_on(requested, device_type: str) -> bool:
    """Whether the engines take a share of the JPEGs: `data.jpeg_engines` with 'auto' settled as on CUDA
    where nvImageCodec is installed (True asks for them anywhere; nvImageCodec's CPU decoder on the CPU)."""
    if requested == "auto":
        return device_type == "cuda" and missing() is None
    return bool(requested)


class _Decoder:
    """One device's nvImageCodec decoder and the images it decodes into, reused batch after batch so that
    the engines' output memory is allocated once (a decoded image is read before the next batch's decode,
    which is ordered after it on the same stream)."""

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
        """Each JPEG (uint8 bytes on the host) as uint8 (3, H, W) on the device, or None where the engines
        could not decode it."""
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
        return [None if image is None else self._tensor(image).permute(2, 0, 1) for image in decoded]

    def _tensor(self, image) -> torch.Tensor:
        """A decoded image (H, W, 3) as a tensor on the device, sharing its memory."""
        if self.device.type == "cuda":
            return torch.as_tensor(image, device=self.device)  # its __cuda_array_interface__
        import numpy as np

        return torch.from_numpy(np.asarray(image))


_DECODERS: dict[torch.device, _Decoder] = {}
_LOCK = threading.Lock()
_REFUSED: list[str] = []  # why the engines decoded none of a batch (the pinning thread's; `EngineShare` reads it)


def decode(jpegs: list[torch.Tensor], device: torch.device) -> list[Optional[torch.Tensor]]:
    """The JPEGs decoded on `device`'s hardware engines (nvImageCodec's CPU decoder on the CPU): uint8 (3, H, W)
    each, None for one they could not decode. Where they decode none of several, or cannot start, every one
    is None and `EngineShare` sends no more JPEGs their way."""
    try:
        with _LOCK:
            if device not in _DECODERS:
                _DECODERS[device] = _Decoder(device)
            decoded = _DECODERS[device].decode(jpegs)
    except Exception as exc:  # no engines on this GPU, a driver too old: the caller decodes them otherwise
        _REFUSED.append(f"{type(exc).__name__}: {exc}")
        return [None] * len(jpegs)
    if len(jpegs) > 1 and all(image is None for image in decoded):
        _REFUSED.append(f"none of {len(jpegs)} JPEGs decoded on {device}")
    return decoded


def to_engines(seed: int, share: float) -> bool:
    """Whether the sample of augmentation seed `seed` goes to the engines at `share`: a draw of its own from the
    seed, so that a share gives the same split on every run."""
    return share > 0 and random.Random(seed).random() < share


class EngineShare:
    """The share of JPEGs the data workers leave to the engines: one float in shared memory, which every
    worker reads per sample and the rank sets. It starts at START and moves by STEP after each window of
    batches (longer than the batches the workers hold ahead, so that a window sees the share it judges): up
    while the step waited for its batches over WAITING of the window, back down when the last raise made
    the wait longer (the engines, not the workers, were then the bottleneck; it is not raised past that again),
    held otherwise."""

    START, STEP, MOST, WAITING = 0.3, 0.05, 0.9, 0.03

    def __init__(self, window: int):
        self.value = torch.full((1,), self.START).share_memory_()
        self.window, self.batches, self.waited, self.spent = window, 0, 0.0, 0.0
        self.last: Optional[float] = None  # the previous window's wait fraction
        self.raised = False  # the last window raised the share
        self.most = self.MOST  # lowered to where the engines kept up

    @property
    def share(self) -> float:
        return float(self.value[0])

    def observe(self, waited: float, spent: float) -> None:
        """One batch: the step waited `waited` seconds for it and spent `spent` seconds between batches."""
        if _REFUSED:
            self.stop(_REFUSED[0])
            return
        self.batches, self.waited, self.spent = self.batches + 1, self.waited + waited, self.spent + spent
        if self.batches < self.window:
            return
        fraction = self.waited / max(self.waited + self.spent, 1e-9)
        share = self.share
        if fraction <= self.WAITING:
            self.raised = False
        elif self.raised and self.last is not None and fraction > self.last + self.WAITING:
            share, self.raised = share - self.STEP, False
            self.most = share
        else:
            share, self.raised = min(self.most, share + self.STEP), share < self.most
        self.value[0] = max(0.0, share)
        self.last, self.batches, self.waited, self.spent = fraction, 0, 0.0, 0.0

    def stop(self, reason: str) -> None:
        """No more JPEGs to the engines (they decode none here)."""
        if self.share:
            log.warning("data: the GPU's JPEG engines decoded none of a batch (%s): the data workers decode every "
                        "JPEG from here on", reason)
        self.value[0] = 0.0
