"""OpenCLIP's random train augmentations where the image is decoded elsewhere: the data workers draw them per
sample seed, as the train transform would, and the device applies the colour ones.

The workers' steps run seeded (`SeededSteps`); for data.decode "gpu" and "mixed" a worker draws each image's
random resized crop box (`crop_box`) and its colour draws (`DeviceCrop.colours`: the colour jitter's order and
factors, the grayscale coin) without the image, and the device applies those draws to the resized batch with
PIL's arithmetic in torch ops (`coloured`: the same pixels give the same pixels).
"""

from __future__ import annotations

import functools
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:
    from torchvision.transforms import RandomResizedCrop


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
        height, width = self.crop.size
        return height, width

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
                self.crop.get_params(torch.empty(0, height, width), list(self.crop.scale), list(self.crop.ratio))
                drawn, *drawn_factors = jitter.get_params(jitter.brightness, jitter.contrast, jitter.saturation,
                                                          jitter.hue)
            order = drawn.tolist()
            factors = [math.nan if factor is None else factor for factor in drawn_factors]
        gray = self.grayscale is not None and coin.random() < self.grayscale.p
        return (*order, *factors, float(gray))


def random_resized_crop(steps: list) -> DeviceCrop:
    """The random resized crop among the worker's steps (the first; bicubic, as OpenCLIP's is) and OpenCLIP's
    colour jitter and grayscale after it, in that order, if there."""
    from open_clip.transform import color_jitter, gray_scale
    from torchvision.transforms import InterpolationMode, RandomResizedCrop

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
            pair = int(torch.empty(attempt + 2, dtype=torch.int64).random_(-2**63, None, generator=_DRAWS)[-1].item())
            return ((pair >> 32) & 0xFFFFFFFF) % (height - h + 1), (pair & 0xFFFFFFFF) % (width - w + 1), h, w
    w, h = width, height
    if width / height < min(crop.ratio):
        h = int(round(w / min(crop.ratio)))
    elif width / height > max(crop.ratio):
        w = int(round(h * max(crop.ratio)))
    return (height - h) // 2, (width - w) // 2, h, w


@functools.cache
def _log_ratio(ratio: tuple[float, float]) -> list[float]:
    """The aspect ratio range's logarithms, as get_params takes them (float32)."""
    return torch.log(torch.tensor(ratio, dtype=torch.float32)).tolist()


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

