"""Training images from encoded bytes to the model's input, split between the data workers and the device.

OpenCLIP's train transform is a random resized crop, RGB, ToTensor and Normalize. The workers run it up
to ToTensor and hand over uint8 pixels (a quarter of float32's bytes through shared memory, pinning and
the host→device copy); the device does ToTensor's `/ 255` and Normalize, as they do it.

With `data.decode` "gpu" the workers only read each JPEG's header and draw its crop with the random
numbers the crop would draw; the batch's JPEGs are decoded with nvJPEG (`torchvision.io.decode_jpeg` on the
device, one call), then cropped and resized all at once as PIL's antialiased bicubic does: separable weight
matrices, two batched matrix products whatever the crops. On CUDA that happens in the DataLoader's pinning
thread (in the rank's main process, ahead of the step, on a stream of its own; nvJPEG releases the GIL), so
the step does not wait for it. Progressive and CMYK JPEGs, JPEGs that do not end where a JPEG ends, and
other formats (PNG, WebP, ...) are decoded on the worker, as with "cpu", and merged into the batch.

OpenCLIP's colour augmentations (`data.preprocess`: colour jitter, grayscale, after the crop) go the same way:
the workers draw each image's coin flips and factors as the transform would, and the device applies them to
the resized batch, PIL's arithmetic in torch ops (`coloured`: the same pixels give the same pixels).

nvJPEG's decode does not overlap a training step that keeps the GPU busy (docs/performance.md,
"Data on real shards"): with "mixed" the workers decode every image (JPEGs with libjpeg-turbo through
torchvision, whose pixels equal PIL's in the tests; others with PIL) and cut its crop; the pinning thread
copies the batch to the device and resizes it there, on its stream, as with "gpu".
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch.utils.data import get_worker_info

from fsdpclip.data.jpeg import Header, rgb_pixels, whole_rgb_jpeg

if TYPE_CHECKING:
    import numpy as np
    from torchvision.transforms import RandomResizedCrop

log = logging.getLogger("fsdpclip.data.transform")
DECODED_WHERE = {"cpu": "by the data workers", "gpu": "on the device (nvJPEG on CUDA)",
                 "mixed": "and cropped by the data workers, resized on the device"}  # per data.decode


def decode_mode(requested: str, device_type: str) -> str:
    """Where training images are decoded: `data.decode`, with "auto" settled as the path measured fastest
    where the run trains: "mixed" on CUDA, "cpu" elsewhere (validate and the trainer both ask here)."""
    if requested != "auto":
        return requested
    return "mixed" if device_type == "cuda" else "cpu"


# ----------------------------------------------------------------------- workers
class SeededSteps:
    """The workers' steps of the train transform, run as Compose runs them with Python's generator seeded as
    torch's is: the stream seeds torch's with each sample's seed, and OpenCLIP's colour jitter and grayscale
    flip their coins with Python's `random`. Python's state is restored after."""

    def __init__(self, transforms: list):
        self.transforms = transforms

    def __call__(self, image):
        state = random.getstate()
        random.seed(torch.initial_seed())
        try:
            for step in self.transforms:
                image = step(image)
            return image
        finally:
            random.setstate(state)


@dataclass
class DeviceCrop:
    """What the workers draw for the device ("gpu", "mixed"): the train transform's random resized crop, and
    the colour augmentations after it (OpenCLIP's `color_jitter` and `gray_scale` steps, or None)."""

    crop: RandomResizedCrop
    jitter: Optional[Any] = None
    grayscale: Optional[Any] = None

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.crop.size)

    def colours(self, height: int, width: int, seed: int) -> Optional[tuple[float, ...]]:
        """An image's colour draws for `coloured` (None without colour augmentations): the jitter's order of
        brightness, contrast, saturation and hue, their factors (NaN: not applied) and whether it is made
        grayscale, drawn as the transform does with `seed` (SeededSteps): the coins with Python's generator,
        the jitter's order and factors with torch's, after the crop's draws for an image of `height` × `width`."""
        if self.jitter is None and self.grayscale is None:
            return None
        coin = random.Random(seed % 2**64)  # torch.initial_seed() after manual_seed(seed)
        order, factors = [0, 1, 2, 3], [math.nan] * 4
        if self.jitter is not None and coin.random() < self.jitter.p:
            jitter = self.jitter.transf
            with torch.random.fork_rng(devices=[]):
                torch.default_generator.manual_seed(seed)
                self.crop.get_params(torch.empty(0, height, width), self.crop.scale, self.crop.ratio)
                drawn, *drawn_factors = jitter.get_params(jitter.brightness, jitter.contrast, jitter.saturation,
                                                          jitter.hue)
            order = drawn.tolist()
            factors = [math.nan if factor is None else factor for factor in drawn_factors]
        gray = self.grayscale is not None and coin.random() < self.grayscale.p
        return (*order, *factors, float(gray))


@dataclass
class EncodedJpeg:
    """A worker's sample for the device to decode: the JPEG, its crop box (top, left, height, width), the
    size (height, width) the crop is resized to and its colour draws (`DeviceCrop.colours`)."""

    data: bytes
    box: tuple[int, int, int, int]
    size: tuple[int, int]
    colours: Optional[tuple[float, ...]] = None


def for_device(data: bytes, header: Header, crop: DeviceCrop, seed: int) -> Optional[EncodedJpeg]:
    """`data` (of `header`) with the box and colours `crop` (the worker transform's: `random_resized_crop`)
    draws for it with torch's generator seeded with `seed` (the same as running the transform so), if the
    device decodes it; None: decode it on the worker."""
    if not whole_rgb_jpeg(data, header) or header.progressive:  # nvJPEG decodes those on the host
        return None
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
    transform so would cut), with its colour draws."""
    top, left, height, width = crop_box(crop.crop, header.height, header.width, seed)
    return CroppedImage(rgb_pixels(data, header)[top:top + height, left:left + width], crop.size,
                        crop.colours(header.height, header.width, seed))


ATTEMPTS = 10  # torchvision's RandomResizedCrop draws up to 10 boxes before it falls back to a central crop
_DRAWS = torch.Generator()  # crop_box's own: torch's default generator is left as it is


def crop_box(crop, height: int, width: int, seed: int) -> tuple[int, int, int, int]:
    """The box (top, left, height, width) that `crop` (a RandomResizedCrop) draws for an image of `height` ×
    `width` with torch's default generator seeded with `seed`: torchvision's `get_params`, draw for draw, in
    three runs of draws and one exp instead of ~8 calls into torch per attempt (a 256-px image with
    OpenCLIP's scale (0.9, 1) needs ~4.7 attempts on average, and 1 in 8 all 10). Each draw is one 32-bit
    output of the generator: an attempt's area is an even draw of a run of uniform draws over the scale,
    its aspect ratio the next, odd, draw of a run over the log ratios (the same kernels make them), and the
    box's corner is the two raw draws after the attempt that fits, modulo the room left (torch.randint's
    rule). No attempt fitting: get_params' central crop. Where torch's default dtype is not float32, its
    draws take other outputs (float64: two each): get_params itself. One generator for the process: not for
    threads (the data workers are processes)."""
    if torch.get_default_dtype() != torch.float32:
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            return crop.get_params(torch.empty(0, height, width), crop.scale, crop.ratio)
    _DRAWS.manual_seed(seed)
    areas = torch.empty(2 * ATTEMPTS).uniform_(*crop.scale, generator=_DRAWS)[0::2].tolist()
    _DRAWS.manual_seed(seed)
    log_ratios = torch.empty(2 * ATTEMPTS).uniform_(*_log_ratio(tuple(crop.ratio)), generator=_DRAWS)
    for attempt, (share, aspect) in enumerate(zip(areas, torch.exp(log_ratios[1::2]).tolist())):
        target_area = height * width * share
        w, h = int(round(math.sqrt(target_area * aspect))), int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            _DRAWS.manual_seed(seed)  # 64-bit draws are two 32-bit ones, the first in the high half
            pair = torch.empty(attempt + 2, dtype=torch.int64).random_(-2**63, None, generator=_DRAWS)[-1].item()
            return ((pair >> 32) & 0xFFFFFFFF) % (height - h + 1), (pair & 0xFFFFFFFF) % (width - w + 1), h, w
    w, h = width, height
    if width / height < min(crop.ratio):
        h = int(round(w / min(crop.ratio)))
    elif width / height > max(crop.ratio):
        w = int(round(h * max(crop.ratio)))
    return (height - h) // 2, (width - w) // 2, h, w


@functools.lru_cache(maxsize=None)
def _log_ratio(ratio: tuple[float, float]) -> list[float]:
    """The aspect ratio range's logarithms, as get_params takes them (float32)."""
    return torch.log(torch.tensor(ratio, dtype=torch.float32)).tolist()


def collate(items: list) -> Union[torch.Tensor, "EncodedBatch", "CroppedBatch"]:
    """One micro batch: the images stacked, with JPEGs for the device an EncodedBatch, or ("mixed") a
    CroppedBatch."""
    if isinstance(items[0], CroppedImage):
        crops = [item.pixels for item in items]
        pixels, release_flag = pooled_batch(padded_shape(crops)) if get_worker_info() is not None else (None, None)
        return CroppedBatch(padded(crops, out=pixels), torch.tensor([(0, 0, *crop.shape[:2]) for crop in crops]),
                            items[0].size, release_flag, _colours(items))
    jpegs = [i for i, item in enumerate(items) if isinstance(item, EncodedJpeg)]
    if not jpegs:
        return torch.stack(items)
    decoded = [i for i, item in enumerate(items) if not isinstance(item, EncodedJpeg)]
    order = [0] * len(items)
    for row, index in enumerate(jpegs + decoded):
        order[index] = row
    data = [items[i].data for i in jpegs]
    return EncodedBatch(torch.frombuffer(bytearray().join(data), dtype=torch.uint8), [len(d) for d in data],
                        torch.tensor([items[i].box for i in jpegs]), items[jpegs[0]].size,
                        torch.stack([items[i] for i in decoded]) if decoded else None, torch.tensor(order),
                        _colours([items[i] for i in jpegs]))


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
    """A micro batch cropped by the workers for the device to resize ("mixed"): the crops zero-padded to
    the largest (in a worker's pooled shared-memory buffer, at least as large as its largest crop times the
    batch), their boxes in that batch (top 0, left 0, height, width), the output size, the buffer's
    release flag (`pooled_batch`) and the colour draws (`coloured`; None: no colour augmentation)."""

    pixels: torch.Tensor  # (batch, H, W, 3) uint8
    boxes: torch.Tensor  # (batch, 4) int64: top, left, height, width
    size: tuple[int, int]
    release_flag: Optional[torch.Tensor] = None  # a worker's pooled buffer's: set once the rank is done reading it
    colours: Optional[torch.Tensor] = None  # (batch, 9) float64

    def pin_memory(self) -> "DecodedBatch":
        """What the DataLoader's pinning thread calls on a batch, ahead of the step: pinned, copied and
        resized on that thread's CUDA device, on a stream of its own (so the copy overlaps the step)."""
        try:
            pinned = CroppedBatch(self.pixels.pin_memory(), self.boxes, self.size, colours=self.colours)
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
        """The crops resized on `device`, their colours augmented: uint8 (batch, 3, *size)."""
        channels_first = self.pixels.to(device, non_blocking=True).permute(0, 3, 1, 2)
        return coloured(resized_crops(channels_first, self.boxes, self.size), self.colours)


@dataclass
class DecodedBatch:
    """A micro batch made the model's pixels on the device by the pinning thread (decoded, cropped and
    resized for 'gpu', resized for 'mixed'): uint8, there once `ready` is."""

    pixels: torch.Tensor  # (batch, 3, H, W) uint8
    ready: torch.cuda.Event


def decoded_pixels(batch: EncodedBatch, device: torch.device) -> torch.Tensor:
    """The batch's pixels on `device` in sample order: uint8 (batch, 3, H, W)."""
    jpegs = _decode_jpegs(list(batch.data.split(batch.lengths)), batch.boxes, device)
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
        return decode_jpeg(jpegs, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        decoded = []
        for jpeg, box in zip(jpegs, boxes.tolist()):
            try:
                decoded.append(decode_jpeg(jpeg, mode=ImageReadMode.RGB, device=device))
            except RuntimeError as exc:
                decoded.append(_decode_on_host(jpeg, box, exc).to(device))
        return decoded


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


def padded_shape(images: list) -> tuple[int, ...]:
    """The shape of `padded(images)`."""
    return (len(images),) + tuple(max(sizes) for sizes in zip(*(image.shape for image in images)))


def padded(images: list, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Images of one layout ((3, h, w) or (h, w, 3); tensors, or uint8 numpy arrays as PIL gives them)
    as one batch, each zero-padded at the end of its height and width to the largest; written into `out`
    (of `padded_shape(images)`, e.g. a worker's `pooled_batch`) if given."""
    shape = padded_shape(images)
    arrays = not isinstance(images[0], torch.Tensor)
    dtype = torch.uint8 if arrays else images[0].dtype
    batch = out if out is not None else torch.empty(shape, dtype=dtype, device="cpu" if arrays else images[0].device)
    ragged = any(image.shape != shape[1:] for image in images)
    if not (ragged or arrays):
        return torch.stack(images, out=batch)
    if ragged:
        batch.zero_()
    slots = batch.numpy() if arrays else batch  # arrays are copied in by numpy (PIL's are read-only)
    for slot, image in zip(slots, images):
        slot[tuple(slice(0, extent) for extent in image.shape)] = image
    return batch


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
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, shape), release_flag


def resized_crops(batch: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Each uint8 image's box (top, left, height, width) resized to `size` as PIL's bicubic resize of the
    crop does (a horizontal pass rounded to 8 bits, then a vertical one): uint8 (n, 3, *size). `batch`
    (n, 3, H, W), of any strides, may be zero-padded (`padded`): a box lies inside its image, and the weights
    outside the box are 0. `boxes` are on the host (they size the weights' band)."""
    count, height, width = batch.shape[0], batch.shape[2], batch.shape[3]
    across = resample_weights(boxes[:, 1], boxes[:, 3], width, size[1], batch.device)  # (n, out width, width)
    down = resample_weights(boxes[:, 0], boxes[:, 2], height, size[0], batch.device)  # (n, out height, height)
    half = _half_products(batch.device)
    rows = batch.permute(0, 2, 1, 3).to(torch.float16 if half else torch.float32,
                                        memory_format=torch.contiguous_format)  # (n, H, 3, W), one pass
    rows = _weighted(rows.view(count, height * 3, width), across.transpose(1, 2), half)  # (n, H·3, out W)
    rows = rows.round_().clamp_(0, 255).view(count, height, 3 * size[1])
    resized = _weighted(down, rows.half() if half else rows, half).round_().clamp_(0, 255)  # (n, out H, 3·out W)
    return resized.view(count, size[0], 3, size[1]).permute(0, 2, 1, 3).to(
        torch.uint8, memory_format=torch.contiguous_format)


def coloured(pixels: torch.Tensor, draws: Optional[torch.Tensor]) -> torch.Tensor:
    """uint8 images (n, 3, H, W) with each row's colour draws (host rows of `DeviceCrop.colours`; None: none)
    applied as OpenCLIP's steps apply them to a PIL image: the jitter's adjustments in its drawn order
    (torchvision's PIL ones), then grayscale; PIL's arithmetic, so the same pixels give the same pixels."""
    if draws is None:
        return pixels
    order, factors, gray = draws[:, :4].long(), draws[:, 4:8], draws[:, 8].bool()

    def rows(chosen: torch.Tensor) -> torch.Tensor:
        return chosen.nonzero().flatten()

    for position in range(4):
        for adjustment, adjust in enumerate(_ADJUSTMENTS):
            chosen = rows((order[:, position] == adjustment) & ~factors[:, adjustment].isnan())
            if len(chosen):
                index = chosen.to(pixels.device, non_blocking=True)
                factor = factors[chosen, adjustment].to(pixels.device, non_blocking=True).view(-1, 1, 1, 1)  # float64
                pixels = pixels.index_copy(0, index, adjust(pixels[index], factor))
    chosen = rows(gray)
    if len(chosen):
        index = chosen.to(pixels.device, non_blocking=True)
        pixels = pixels.index_copy(0, index, _luma(pixels[index]).to(torch.uint8).expand(-1, 3, -1, -1))
    return pixels


def _luma(pixels: torch.Tensor) -> torch.Tensor:
    """PIL's RGB → L, int32 (n, 1, H, W): (19595 R + 38470 G + 7471 B + 2^15) >> 16."""
    red, green, blue = pixels.int().split(1, dim=1)
    return (red * 19595 + green * 38470 + blue * 7471 + 0x8000) >> 16


def _blend(degenerate: torch.Tensor, pixels: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's Image.blend(degenerate, image, factor) (ImageEnhance's): degenerate + factor × (image - degenerate)
    in float32, clipped to 0..255 and truncated."""
    degenerate = degenerate.float()
    return (pixels.float() - degenerate).mul_(factor.float()).add_(degenerate).clamp_(0, 255).trunc_().to(torch.uint8)


def _brightness(pixels: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(torch.zeros((), device=pixels.device), pixels, factor)


def _contrast(pixels: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Blended with the image's mean gray level, rounded (ImageStat's mean of the L image, in float64)."""
    luma = _luma(pixels)
    mean = luma.sum(dim=(1, 2, 3), dtype=torch.int64).double().div_(luma[0].numel()).add_(0.5).floor_()
    return _blend(mean.view(-1, 1, 1, 1), pixels, factor)


def _saturation(pixels: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(_luma(pixels), pixels, factor)


def _hue(pixels: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """torchvision's PIL adjust_hue: PIL's 8-bit HSV (Convert.c's rgb2hsv, float and double steps as it
    takes them), the hue byte shifted by int(factor × 255) modulo 256, and PIL's HSV → RGB."""
    red, green, blue = pixels.int().unbind(1)
    high = torch.maximum(torch.maximum(red, green), blue)
    low = torch.minimum(torch.minimum(red, green), blue)
    spread = (high - low).float()
    grey = spread == 0
    divisor = torch.where(grey, 1.0, spread)
    saturation = spread / high.float().clamp(min=1)
    rc, gc, bc = ((high - channel).float().div_(divisor) for channel in (red, green, blue))
    hue = torch.where(red == high, (bc - gc).double(), torch.where(  # the first in float, the others in double
        green == high, 2.0 + rc.double() - bc.double(), 4.0 + gc.double() - rc.double())).float()
    hue = torch.fmod(hue.double() / 6.0 + 1.0, 1.0).float()
    h = torch.where(grey, 0, (hue.double() * 255.0).trunc().clamp(0, 255).long())
    s = torch.where(grey, 0, (saturation.double() * 255.0).trunc().clamp(0, 255).long())
    h = (h + (factor.view(-1, 1, 1) * 255).trunc().long()) % 256  # np.int32(f × 255) as uint8
    sixths = h.double() * 6.0 / 255.0
    sector = sixths.floor()
    shade = (sixths - sector).float() * s.float()  # fs
    value = high.double()
    p = torch.round(value * (255.0 - s.double()) / 255.0).clamp(0, 255).int()
    q = torch.round(value * (255.0 - shade.double()) / 255.0).clamp(0, 255).int()
    t = torch.round(value * (255.0 - s.double() + shade.double()) / 255.0).clamp(0, 255).int()
    v = high
    sector = sector.long() % 6
    channels = []
    for chosen in zip((v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)):  # per channel, per sector
        channel = v
        for index, value_of_sector in enumerate(chosen):
            channel = torch.where(sector == index, value_of_sector, channel)
        channels.append(torch.where(s == 0, v, channel))
    return torch.stack(channels, 1).to(torch.uint8)


_ADJUSTMENTS = (_brightness, _contrast, _saturation, _hue)  # ColorJitter's order numbers


def _half_products(device: torch.device) -> bool:
    """Whether the resize's products run as float16 tensor-core products with float32 results (CUDA, and a
    torch whose bmm takes out_dtype); else they run in float32."""
    return device.type == "cuda" and hasattr(torch.ops.aten.bmm, "dtype")


def _weighted(first: torch.Tensor, second: torch.Tensor, half: bool) -> torch.Tensor:
    """first @ second (batched; one is pixels, integers in 0..255, the other float32 weights) in float32.
    `half`: the pixels are float16 (exact), and the weights are split into a float16 part and its float16
    remainder (~22 bits, near float32's 24): two tensor-core products, each accumulated in float32."""
    if not half:
        return torch.bmm(first, second)
    weights_first = first.dtype == torch.float32
    weights = first if weights_first else second
    high = weights.half()
    low = (weights - high).half()
    product = ((lambda w: torch.bmm(w, second, out_dtype=torch.float32)) if weights_first else
               (lambda w: torch.bmm(first, w, out_dtype=torch.float32)))
    return product(high).add_(product(low))


def resample_weights(start: torch.Tensor, length: torch.Tensor, extent: int, out: int,
                     device: torch.device) -> torch.Tensor:
    """(n, out, extent) weights on `device` taking each row's [start, start + length) (host tensors) of
    `extent` pixels to `out` samples: PIL's ImagingResample coefficients for bicubic (a = -0.5), its support
    (2) widened by the downscaling factor, the taps inside the crop normalised to sum to 1. Computed at
    each sample's taps only (a band as wide as the widest support), then spread into the dense matrix."""
    taps = math.ceil(4 * max(1.0, float(length.max()) / out)) + 2  # covers every centre's open support
    start, length = (v.to(device, non_blocking=True).float()[:, None, None] for v in (start, length))
    scale = length / out
    stretch = scale.clamp(min=1)
    centres = start + (torch.arange(out, device=device)[None, :, None] + 0.5) * scale  # (n, out, 1)
    first = (centres - 0.5 - 2 * stretch).floor()
    index = first + torch.arange(taps, device=device)  # (n, out, taps): pixel numbers, exact in float
    pixels = index + 0.5
    distance = ((pixels - centres) / stretch).abs()
    a = -0.5
    weights = torch.where(distance < 1, ((a + 2) * distance - (a + 3)) * distance * distance + 1,
                          torch.where(distance < 2, (((distance - 5) * distance + 8) * distance - 4) * a, 0.0))
    weights = weights * ((pixels > start) & (pixels < start + length))
    weights = weights / weights.sum(-1, keepdim=True)
    dense = torch.zeros(weights.shape[0], out, extent, device=device)
    return dense.scatter_add_(2, index.long().clamp_(0, extent - 1), weights)  # taps past an edge weigh 0


def random_resized_crop(steps: list) -> DeviceCrop:
    """The random resized crop among the worker's steps (the first; bicubic, as OpenCLIP's is) and OpenCLIP's
    colour jitter and grayscale after it, in that order, if there."""
    from open_clip.transform import color_jitter, gray_scale
    from torchvision.transforms import InterpolationMode

    from torchvision.transforms import RandomResizedCrop

    crops = [step for step in steps if isinstance(step, RandomResizedCrop)]
    if len(crops) != 1 or crops[0] is not steps[0] or crops[0].interpolation != InterpolationMode.BICUBIC:
        raise ValueError(f"data.decode 'gpu' needs one bicubic random resized crop first in the model's train "
                         f"transform; it has {steps}: use data.decode 'cpu'")
    jitter = next((step for step in steps if isinstance(step, color_jitter)), None)
    grayscale = next((step for step in steps if isinstance(step, gray_scale)), None)
    if jitter is not None and grayscale is not None and steps.index(grayscale) < steps.index(jitter):
        raise ValueError("the model's train transform makes images grayscale before it jitters their colours; "
                         "the device does it after: use data.decode 'cpu'")
    return DeviceCrop(crops[0], jitter, grayscale)


def _to_rgb(step) -> bool:
    """Whether a step only converts the image to RGB (which the device's decode to RGB already did)."""
    return getattr(step, "mode", None) == "RGB" or getattr(step, "__name__", "") == "_convert_to_rgb"
