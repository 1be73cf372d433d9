"""Training images from encoded bytes to the model's input, split between the data workers and the device.

OpenCLIP's train transform is a random resized crop, RGB, ToTensor and Normalize. The workers run it up
to ToTensor and hand over uint8 pixels (a quarter of float32's bytes through shared memory, pinning and
the host→device copy); the device does ToTensor's `/ 255` and Normalize, as they do it.

With `data.decode` "gpu" the workers only read each JPEG's header and draw its crop with the random numbers
the crop would draw (`augment.crop_box`); the batch's JPEGs are decoded with nvJPEG
(`torchvision.io.decode_jpeg` on the device, one call), then cropped and resized all at once as PIL's
antialiased bicubic does (`resize.resized_crops`). On CUDA that happens in the DataLoader's pinning thread (in
the rank's main process, ahead of the step, on a stream of its own; nvJPEG releases the GIL), so the step does
not wait for it. Progressive and CMYK JPEGs, JPEGs that do not end where a JPEG ends, and other formats (PNG,
WebP, ...) are decoded on the worker, as with "cpu", and merged into the batch.

OpenCLIP's colour augmentations (`data.preprocess`: colour jitter, grayscale, after the crop) go the same way:
the workers draw each image's coin flips and factors as the transform would, and the device applies them to
the resized batch, PIL's arithmetic in torch ops (`augment.coloured`: the same pixels give the same pixels).

nvJPEG's decode does not overlap a training step that keeps the GPU busy (docs/performance.md,
"Data on real shards"): with "mixed" the workers decode every image (JPEGs with libjpeg-turbo through
torchvision, whose pixels equal PIL's in the tests; others with PIL) and cut its crop; the pinning thread
copies the batch to the device and resizes it there, on its stream, as with "gpu". With `data.jpeg_engines`
the workers leave a share of the JPEGs encoded, as for "gpu", and the pinning thread decodes those on the
GPU's hardware JPEG engines (`fsdpclip.data.engines`) beside resizing the others' crops.
"""

from __future__ import annotations

import io
import logging
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

import torch
from torch.utils.data import get_worker_info

from fsdpclip.data.augment import DeviceCrop, SeededSteps, coloured, crop_box, random_resized_crop
from fsdpclip.data.jpeg import Header, rgb_pixels, whole_rgb_jpeg
from fsdpclip.data.resize import resized_crops

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("fsdpclip.data.transform")
DECODED_WHERE = {"cpu": "by the data workers", "gpu": "on the device (nvJPEG on CUDA)",
                 "mixed": "and cropped by the data workers, resized on the device",
                 "mixed+engines": "and cropped by the data workers, resized on the device, a share of the JPEGs "
                                  "decoded on the GPU's hardware JPEG engines"}  # per data.decode (and jpeg_engines)


def decode_mode(requested: str, device_type: str) -> str:
    """Where training images are decoded: `data.decode`, with "auto" settled as the path measured fastest
    where the run trains: "mixed" on CUDA, "cpu" elsewhere (validate and the trainer both ask here)."""
    if requested != "auto":
        return requested
    return "mixed" if device_type == "cuda" else "cpu"


# ----------------------------------------------------------------------- workers
LARGEST_ON_DEVICE = 16  # times the output's pixels: a larger image ('gpu') or crop ('mixed') is resized on the worker
@dataclass
class EncodedJpeg:
    """A worker's sample for the device to decode: the JPEG, its crop box (top, left, height, width), the
    size (height, width) the crop is resized to and its colour draws (`DeviceCrop.colours`)."""

    data: bytes
    box: tuple[int, int, int, int]
    size: tuple[int, int]
    colours: Optional[tuple[float, ...]] = None
    engines: bool = False  # decoded on the GPU's hardware JPEG engines ("mixed"), not nvJPEG's CUDA decode


def for_device(data: bytes, header: Header, crop: DeviceCrop, seed: int) -> Optional[EncodedJpeg]:
    """`data` (of `header`) with the box and colours `crop` (the worker transform's: `random_resized_crop`)
    draws for it with torch's generator seeded with `seed` (the same as running the transform so), if the
    device decodes it; None: decode it on the worker (so are images of more than LARGEST_ON_DEVICE times the
    output's pixels: one would pad every decoded image of its batch to its size on the device)."""
    if not whole_rgb_jpeg(data, header) or header.progressive:  # nvJPEG decodes those on the host
        return None
    if header.height * header.width > LARGEST_ON_DEVICE * crop.size[0] * crop.size[1]:
        return None  # the batch's decoded images are padded to the largest
    return EncodedJpeg(data, crop_box(crop.crop, header.height, header.width, seed), crop.size,
                       crop.colours(header.height, header.width, seed))


@dataclass
class CroppedImage:
    """A worker's sample for the device to resize ("mixed"): its crop (the box the worker transform's
    random resized crop draws) of the decoded image, RGB uint8 (h, w, 3) as the decoder left it (a numpy
    view; made channels-first on the device), the size it is resized to and its colour draws."""

    pixels: np.ndarray
    size: tuple[int, int]
    colours: Optional[tuple[float, ...]] = None


def cropped(data: bytes, header: Header, crop: DeviceCrop, seed: int) -> CroppedImage:
    """`data` (of `header`) decoded to RGB and cut to the box `crop` (the worker transform's:
    `random_resized_crop`) draws for it with torch's generator seeded with `seed` (the box running the
    transform so would cut), with its colour draws. A crop of more than LARGEST_ON_DEVICE times the output's
    pixels is resized here, as the worker transform resizes it (PIL's), so that one large photo does not pad
    every crop of its batch to its size; the device's resize of it is then the identity."""
    top, left, height, width = crop_box(crop.crop, header.height, header.width, seed)
    pixels = rgb_pixels(data, header)[top:top + height, left:left + width]
    if height * width > LARGEST_ON_DEVICE * crop.size[0] * crop.size[1]:  # the batch is padded to its largest crop
        import numpy as np
        from PIL import Image
        from torchvision.transforms.functional import resize

        pixels = np.asarray(resize(Image.fromarray(pixels), list(crop.size), crop.crop.interpolation))  # pyright: ignore[reportArgumentType]  (PIL images too)
    return CroppedImage(pixels, crop.size, crop.colours(header.height, header.width, seed))


def collate(items: list) -> Union[torch.Tensor, "EncodedBatch", "CroppedBatch"]:
    """One micro batch: the images stacked, with JPEGs for the device an EncodedBatch, or ("mixed") a
    CroppedBatch (with the JPEGs left to the hardware engines, if any)."""
    jpegs = [i for i, item in enumerate(items) if isinstance(item, EncodedJpeg)]
    others = [i for i, item in enumerate(items) if not isinstance(item, EncodedJpeg)]
    if isinstance(items[others[0]] if others else None, CroppedImage):
        crops = [items[i].pixels for i in others]
        pixels, release_flag = packed(crops)
        return CroppedBatch(pixels, torch.tensor([(0, 0, *crop.shape[:2]) for crop in crops]), items[0].size,
                            release_flag, _colours([items[i] for i in others]),
                            _encoded([items[i] for i in jpegs]) if jpegs else None,
                            _order(others, jpegs) if jpegs else None)
    if not jpegs:
        return torch.stack(items)
    encoded = _encoded([items[i] for i in jpegs])
    encoded.pixels = torch.stack([items[i] for i in others]) if others else None
    encoded.order = _order(jpegs, others)
    return encoded


def _encoded(jpegs: list[EncodedJpeg]) -> "EncodedBatch":
    """JPEGs for the device as one batch, in their order (no pixels from the worker)."""
    data = [jpeg.data for jpeg in jpegs]
    return EncodedBatch(torch.frombuffer(bytearray().join(data), dtype=torch.uint8), [len(d) for d in data],
                        torch.tensor([jpeg.box for jpeg in jpegs]), jpegs[0].size, None, torch.arange(len(jpegs)),
                        _colours(jpegs), jpegs[0].engines)


def _order(first: list[int], then: list[int]) -> torch.Tensor:
    """Where each sample's row is when the samples at `first` come first and those at `then` after them."""
    order = [0] * (len(first) + len(then))
    for row, index in enumerate(first + then):
        order[index] = row
    return torch.tensor(order)


def _colours(items: list) -> Optional[torch.Tensor]:
    """The samples' colour draws as one (samples, 9) float64 tensor; None without colour augmentations."""
    return None if items[0].colours is None else torch.tensor([item.colours for item in items], dtype=torch.float64)


@dataclass
class EncodedBatch:
    """A micro batch whose JPEGs the device decodes: their bytes end to end (one tensor crosses from the
    worker, not one per image), crop boxes and output size, the pixels of the images decoded on the
    worker (augmented there), `order`: sample i is row order[i] of the JPEGs followed by the decoded images,
    and the JPEGs' colour draws (`coloured`; None: no colour augmentation)."""

    data: torch.Tensor  # uint8
    lengths: list[int]
    boxes: torch.Tensor  # (jpegs, 4) int64: top, left, height, width
    size: tuple[int, int]
    pixels: Optional[torch.Tensor]  # (decoded, 3, *size) uint8
    order: torch.Tensor  # (batch,) int64
    colours: Optional[torch.Tensor] = None  # (jpegs, 9) float64
    engines: bool = False  # decoded on the GPU's hardware JPEG engines, not with nvJPEG

    def pin_memory(self) -> "DecodedBatch":
        """What the DataLoader's pinning thread calls on a batch, ahead of the step: decodes it on that
        thread's CUDA device, on a stream of its own."""
        return _ahead_of_the_step(lambda device: decoded_pixels(self, device))


def _ahead_of_the_step(pixels_on) -> "DecodedBatch":
    """`pixels_on(device)` run on the pinning thread's CUDA device and stream, so that the step's stream
    does not wait for it: the batch's uint8 pixels, there once the returned batch is ready."""
    device = torch.device("cuda", torch.cuda.current_device())
    if device.index not in _STREAMS:
        _STREAMS[device.index] = torch.cuda.Stream(device)
    stream = _STREAMS[device.index]
    with torch.cuda.stream(stream):
        pixels = pixels_on(device)
        ready = torch.cuda.Event()
        ready.record(stream)
    return DecodedBatch(pixels, ready)


_STREAMS: dict[int, torch.cuda.Stream] = {}  # the pinning thread's stream, per device


@dataclass
class CroppedBatch:
    """A micro batch cropped by the workers for the device to resize ("mixed"): the crops end to end
    (`packed`: in a worker's pooled shared-memory buffer, no padding crossing to the rank), their boxes in
    that batch (top 0, left 0, height, width), the output size, the buffer's release flag (`pooled_batch`)
    and the colour draws (`coloured`; None: no colour augmentation); with `data.jpeg_engines`, the JPEGs the
    workers left to the engines and `order`: sample i is row order[i] of the crops followed by the JPEGs."""

    pixels: torch.Tensor  # (bytes,) uint8: `packed` crops
    boxes: torch.Tensor  # (crops, 4) int64: top, left, height, width
    size: tuple[int, int]
    release_flag: Optional[torch.Tensor] = None  # a worker's pooled buffer's: set once the rank is done reading it
    colours: Optional[torch.Tensor] = None  # (crops, 9) float64
    jpegs: Optional[EncodedBatch] = None  # for the hardware JPEG engines
    order: Optional[torch.Tensor] = None  # (batch,) int64, with `jpegs`

    def pin_memory(self) -> "DecodedBatch":
        """What the DataLoader's pinning thread calls on a batch, ahead of the step: pinned, copied and
        resized on that thread's CUDA device, on a stream of its own (so the copy overlaps the step)."""
        try:
            pinned = CroppedBatch(self.pixels.pin_memory(), self.boxes, self.size, colours=self.colours,
                                  jpegs=self.jpegs, order=self.order)
        finally:
            self.release()
        return _ahead_of_the_step(pinned.resized)

    def release(self) -> None:
        """Hands the pixels' buffer back to the worker that made it, once (the rank holds a copy, or is done;
        from here on the worker may write it again). The flag is set after the reads in program order; on
        x86 that is enough; elsewhere, likely, the interpreter lock taken between them (a mutex) orders it."""
        if self.release_flag is not None:
            self.release_flag.fill_(1)
            self.release_flag = None

    def resized(self, device: torch.device) -> torch.Tensor:
        """The crops resized on `device`, their colours augmented, with the JPEGs decoded there, if any: uint8
        (batch, 3, *size) in sample order."""
        crops = unpacked(self.pixels.to(device, non_blocking=True), self.boxes)
        pixels = coloured(resized_crops(crops.permute(0, 3, 1, 2), self.boxes, self.size), self.colours)
        if self.jpegs is None:
            return pixels
        assert self.order is not None  # with the JPEGs
        return torch.cat([pixels, decoded_pixels(self.jpegs, device)])[self.order.to(device, non_blocking=True)]


@dataclass
class DecodedBatch:
    """A micro batch made the model's pixels on the device by the pinning thread (decoded, cropped and
    resized for 'gpu', resized for 'mixed'): uint8, there once `ready` is."""

    pixels: torch.Tensor  # (batch, 3, H, W) uint8
    ready: torch.cuda.Event


def decoded_pixels(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    """The batch's pixels on `device` in sample order: uint8 (batch, 3, H, W)."""
    jpegs = list(batch.data.split(batch.lengths))
    jpegs = _on_engines(jpegs, batch.boxes, device) if batch.engines else _decode_jpegs(jpegs, batch.boxes, device)
    pixels = coloured(resized_crops(padded(jpegs), batch.boxes, batch.size), batch.colours)
    if batch.pixels is not None:
        pixels = torch.cat([pixels, batch.pixels.to(device, non_blocking=True)])
    return pixels[batch.order.to(device, non_blocking=True)]


def _decode_jpegs(jpegs: list[torch.Tensor], boxes: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """The JPEGs decoded to RGB on `device`, in one call. One the decoder refuses fails that call: then they
    go one by one, and one it refuses is decoded by PIL, as a worker would; one PIL cannot decode either
    (it passed the worker's checks of its header and end) becomes a black image covering its box."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return list(decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device))  # a list in, a list out
    except RuntimeError:
        decoded = []
        for jpeg, box in zip(jpegs, boxes.tolist()):
            try:
                decoded.append(decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=device))
            except RuntimeError as exc:
                decoded.append(_decode_on_host(jpeg, box, exc).to(device))
        return decoded


def _on_engines(jpegs: list[torch.Tensor], boxes: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """The JPEGs decoded on `device`'s hardware JPEG engines; those they could not decode as `_decode_jpegs`
    decodes them."""
    from fsdpclip.data import engines

    decoded = engines.decode(jpegs, device)
    refused = [i for i, image in enumerate(decoded) if image is None]
    if refused:
        for i, image in zip(refused, _decode_jpegs([jpegs[i] for i in refused], boxes[refused], device)):
            decoded[i] = image
    return [image for image in decoded if image is not None]  # (each one decoded now)


def _decode_on_host(jpeg: torch.Tensor, box: list[int], refused: Exception) -> torch.Tensor:
    from PIL import Image
    from torchvision.transforms.functional import pil_to_tensor

    try:
        image = Image.open(io.BytesIO(jpeg.numpy().tobytes())).convert("RGB")
        log.warning("the JPEG decoder refused an image (%s); PIL decoded it", refused)
        return pil_to_tensor(image)
    except Exception as exc:  # a broken sample must never stop the run
        log.warning("an undecodable JPEG (%s; PIL: %s) is a black image in its batch", refused, exc)
        top, left, height, width = box
        return torch.zeros(3, top + height, left + width, dtype=torch.uint8)


# ------------------------------------------------------------------------ device
class TrainImages:
    """OpenCLIP's train transform for one rank, cut at ToTensor: `worker_transform` (PIL image → uint8
    tensor) for the data workers, and the call that turns a micro batch into the model's input on
    `device`, bit for bit what the whole transform gives for the worker's pixels."""

    def __init__(self, transform, decode: str, device: torch.device):
        from torchvision.transforms import Normalize, PILToTensor, ToTensor

        steps = list(getattr(transform, "transforms", ()))
        cut = next((i for i, step in enumerate(steps) if isinstance(step, ToTensor)), None)
        if cut is None or len(steps) != cut + 2 or not isinstance(steps[-1], Normalize):
            raise ValueError(f"the model's train transform is not <PIL steps>, ToTensor, Normalize, so it cannot "
                             f"be split between the data workers and the device: {transform}")
        self.worker_transform = SeededSteps(steps[:cut] + [PILToTensor()])
        self.device, self.decode = device, decode
        normalize = steps[-1]
        self.mean, self.std = (torch.as_tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1)
                               for v in (normalize.mean, normalize.std))
        if decode in ("gpu", "mixed"):
            crop = random_resized_crop(steps[:cut])
            done = (crop.crop, crop.jitter, crop.grayscale)
            extra = [step for step in steps[:cut] if step not in done and not _to_rgb(step)]
            if extra:
                raise ValueError(f"data.decode '{decode}' crops and resizes on the device (with OpenCLIP's colour "
                                 f"jitter and grayscale), but the model's train transform also does {extra}: use "
                                 "data.decode 'cpu'")

    def __call__(self, batch: Union[torch.Tensor, EncodedBatch, DecodedBatch, CroppedBatch]) -> torch.Tensor:
        """The model's input: float32 (batch, 3, H, W), normalised, on the device (asynchronous)."""
        if isinstance(batch, CroppedBatch):  # no pinning thread (pin_memory off): resize here
            try:  # CUDA copies from pageable memory return once the source is read, non_blocking or not
                pixels = batch.resized(self.device)
            finally:
                batch.release()
        elif isinstance(batch, DecodedBatch):
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(batch.ready)
            batch.pixels.record_stream(stream)  # made on the pinning thread's stream, used on this one
            pixels = batch.pixels
        elif isinstance(batch, EncodedBatch):  # no pinning thread (not on CUDA): decode here
            pixels = decoded_pixels(batch, self.device)
        else:
            pixels = batch.to(self.device, non_blocking=True)
        return pixels.float().div_(255).sub_(self.mean).div_(self.std)  # ToTensor's scaling, then Normalize


def padded(images: list[torch.Tensor]) -> torch.Tensor:
    """Images (c, h, w) of one device as one batch, each padded at the end of its height and width to the
    largest (with whatever the memory held: `resized_crops` weighs only each image's box)."""
    shape = (len(images),) + tuple(max(sizes) for sizes in zip(*(image.shape for image in images)))
    if all(image.shape == shape[1:] for image in images):
        return torch.stack(images)
    batch = images[0].new_empty(shape)
    for slot, image in zip(batch, images):
        slot[:, :image.shape[1], :image.shape[2]] = image
    return batch


def packed(crops: list["np.ndarray"]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """uint8 crops (h, w, 3) end to end, each row-major, then 3 × the widest crop's width zero bytes (the room
    `unpacked` reads past the last crop), and the buffer's release flag: in a data worker, a buffer of its
    pool (`pooled_batch`), else fresh memory and no flag. Nothing is padded: the rank pins and copies only
    the crops' bytes (a batch's crops padded to its largest were 2.1-2.7× as many on DataComp-sized images)."""
    import numpy as np

    sizes = [crop.size for crop in crops]
    room = 3 * max(crop.shape[1] for crop in crops)
    shape = (sum(sizes) + room,)
    flat, release_flag = pooled_batch(shape) if get_worker_info() is not None else (
        torch.empty(shape, dtype=torch.uint8), None)
    out, at = flat.numpy(), 0
    for crop, size in zip(crops, sizes):
        np.copyto(out[at:at + size].reshape(crop.shape), crop)  # PIL's arrays are read-only views
        at += size
    out[at:] = 0
    return flat, release_flag


def unpacked(flat: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
    """`packed` crops (sizes: `boxes`' heights and widths) as one (n, H, W, 3) batch of the largest height and
    width, on `flat`'s device in one gather: row y of crop i is the 3·W bytes from that row's start (crop
    i's last row past its height). Past each crop's own width and height the batch holds the next bytes,
    which `resized_crops` weighs 0."""
    height, width = (int(extent) for extent in boxes[:, 2:].max(0).values)
    heights, widths = boxes[:, 2:].to(flat.device, non_blocking=True).unbind(1)
    sizes = 3 * heights * widths
    rows = torch.arange(height, device=flat.device)[None, :].minimum(heights[:, None] - 1)
    starts = (sizes.cumsum(0) - sizes)[:, None] + 3 * widths[:, None] * rows  # (n, H), made on the device
    windows = flat.unfold(0, 3 * width, 1)  # every 3·W bytes from every byte: a view
    return windows.index_select(0, starts.flatten()).view(len(boxes), height, width, 3)


POOLED = 6  # a worker's pooled batch buffers: DataLoader's prefetch (4, the one being made among them), the
# batch the rank holds, one spare
_POOL: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # this process's: (buffer, its release flag)
os.register_at_fork(after_in_child=lambda: _POOL.clear())  # a worker never shares its parent's buffers


def pooled_batch(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """A uint8 batch of `shape` in shared memory (so it crosses to the rank's process without another copy)
    from this data worker's pool, and its release flag, which the rank sets once it is done reading it
    (`CroppedBatch.release`). Fresh shared memory costs a page fault per 4 KiB on its first write (~0.1 ms
    per 256² crop); a released buffer is written again without one. Only a released buffer is handed out
    again, so a batch the rank has not released never changes. The smallest free one that fits is taken;
    with none, a new one (an eighth larger than needed) replaces the smallest free one, or joins the pool,
    or (pool full, all in use) is used once. The pool keeps up to POOLED buffers, as large as the largest
    batches seen, for the worker's life."""
    needed = math.prod(shape)
    free = [entry for entry in _POOL if entry[1].item()]
    entry = min((entry for entry in free if entry[0].nbytes() >= needed), key=lambda e: e[0].nbytes(), default=None)
    if entry is None:
        entry = (torch.UntypedStorage._new_shared(needed + needed // 8),
                 torch.zeros(1, dtype=torch.int32).share_memory_())
        if free:
            _POOL.remove(min(free, key=lambda e: e[0].nbytes()))
        if len(_POOL) < POOLED:
            _POOL.append(entry)
    storage, release_flag = entry
    release_flag.zero_()
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape), release_flag  # pyright: ignore[reportCallIssue]  (untyped storage)


def _to_rgb(step) -> bool:
    """Whether a step only converts the image to RGB (which the device's decode to RGB already did)."""
    return getattr(step, "mode", None) == "RGB" or getattr(step, "__name__", "") == "_convert_to_rgb"
