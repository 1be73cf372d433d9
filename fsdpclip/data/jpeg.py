"""Encoded images read on the host: a JPEG's header without decoding it (PIL's where PIL must read it), and
the RGB pixels PIL would give (libjpeg-turbo through torchvision for plain JPEGs). What the data workers
use to decide where an image is decoded (`fsdpclip.data.transform`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

DEVICE_MODES = ("RGB", "L")  # JPEG modes decode_jpeg turns into RGB as PIL's convert("RGB") does


@dataclass
class Header:
    """What a worker knows of an encoded image before decoding it: PIL's format and mode, its size, whether
    it is a progressive JPEG, and PIL's image where PIL read the header (`read_header`)."""

    format: str
    mode: str
    height: int
    width: int
    progressive: bool
    opened: Optional["Image.Image"] = None

    def image(self, data: bytes) -> "Image.Image":
        """`data` opened by PIL (its pixels not yet read)."""
        from PIL import Image

        return self.opened if self.opened is not None else Image.open(io.BytesIO(data))


_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # SOFn: a frame header
_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}  # PIL's info["progressive"]
_RESTARTS = range(0xD0, 0xD8)  # RSTn: no length
# Segments with a length that PIL reads or skips: DHT, DAC, SOS, DQT, DNL, DRI, EXP, APPn, COM, and the frames.
_SEGMENTS = {0xC4, 0xCC, 0xDA, 0xDB, 0xDC, 0xDD, 0xDF, 0xFE, *range(0xE0, 0xF0), *_FRAMES}


def read_header(data: bytes) -> Header:
    """`data`'s header. A plain JPEG (8-bit, 1 or 3 components, segments that PIL reads without a doubt and
    that change nothing about how it is opened) is read here, segment by segment up to its first scan: PIL's
    `Image.open` took 0.10-0.11 ms per image in a 'mixed' worker on an H200 host. Anything else (other
    formats, CMYK, EXIF, Photoshop and MPO segments, short or cut segments, markers PIL reads otherwise) is
    opened by PIL, which raises for what it cannot open. Where this reads a header, PIL reads the same
    (tests/test_decode.py checks it on cut and damaged JPEGs). An image of more pixels than PIL's limit is
    refused before anything decodes it (`refuse_huge`)."""
    from PIL import Image

    header = _plain_jpeg_header(data)
    if header is None:
        image = Image.open(io.BytesIO(data))
        header = Header(image.format or "", image.mode, image.height, image.width, bool(image.info.get("progressive")),
                        image)
    refuse_huge(header.height, header.width)
    return header


def refuse_huge(height: int, width: int) -> None:
    """The decompression-bomb guard of every decode path: an image of more pixels than PIL's
    `Image.MAX_IMAGE_PIXELS` (89.5 million unless changed; None: no limit) raises DecompressionBombError, a
    broken sample. PIL alone raises only past twice its limit (it warns between), and would decode a
    100-megapixel image; the device paths pad a batch to its largest image, so one such image would make every
    image of its batch that large (a 256-image batch: 77 GB)."""
    from PIL import Image

    limit = Image.MAX_IMAGE_PIXELS
    if limit is not None and height * width > limit:
        raise Image.DecompressionBombError(f"an image of {width}×{height} = {height * width:,} pixels, over PIL's "
                                           f"limit of {limit:,} (PIL.Image.MAX_IMAGE_PIXELS): a decompression bomb "
                                           "or an image to shrink (fsdpclip data resize)")


def _plain_jpeg_header(data: bytes) -> Optional[Header]:
    """`data`'s header if it is a plain JPEG as `read_header` says, else None."""
    if not data.startswith(b"\xff\xd8\xff"):
        return None
    frame, at = None, 2
    while at + 4 <= len(data) and data[at] == 0xFF:
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in _RESTARTS:
            at += 2
            continue
        length = int.from_bytes(data[at + 2:at + 4], "big")
        segment = data[at + 4:at + 2 + length]
        if marker not in _SEGMENTS or length < 2 or len(segment) < length - 2 or not _plain_segment(marker, segment):
            return None
        if marker == 0xDA:  # the first scan: the header is whole
            return frame
        if marker in _FRAMES:
            if frame is not None or len(segment) < 6 or segment[0] != 8 or segment[5] not in (1, 3) or \
                    len(segment) != 6 + 3 * segment[5]:  # a component's entry is 3 bytes (PIL and libjpeg read them)
                return None
            frame = Header("JPEG", "RGB" if segment[5] == 3 else "L", int.from_bytes(segment[1:3], "big"),
                           int.from_bytes(segment[3:5], "big"), marker in _PROGRESSIVE)
            if not frame.height or not frame.width:
                return None
        at += 2 + length
    return None


def _plain_segment(marker: int, segment: bytes) -> bool:
    """Whether PIL reads this segment's payload without raising and keeps nothing from it that bears on how
    the image is opened (its quantisation tables whole; JFIF, Adobe and ICC payloads as long as PIL reads
    them; no EXIF (PIL parses it on opening), Photoshop resources or MPO index)."""
    if marker == 0xDB:  # DQT: tables of 64 values, each of 1 or 2 bytes by its first byte's high half
        at = 0
        while at < len(segment):
            at += 1 + 64 * (1 if segment[at] < 16 else 2)
        return at == len(segment)
    if marker == 0xE0 and segment.startswith(b"JFIF"):
        return len(segment) >= 7
    if marker == 0xEE and segment.startswith(b"Adobe"):
        return len(segment) >= 7
    if marker == 0xE2 and segment.startswith(b"ICC_PROFILE\0"):
        return len(segment) >= 14
    return not (marker == 0xE1 and segment.startswith(b"Exif\0\0") or marker == 0xE2 and segment.startswith(b"MPF\0")
                or marker == 0xED and segment.startswith(b"Photoshop 3.0\0"))


def whole_rgb_jpeg(data: bytes, header: Header) -> bool:
    """Whether `data` (of `header`) is a JPEG that decode_jpeg decodes to PIL's RGB: RGB or grayscale,
    ending where a JPEG ends (a cut one goes to PIL, which decides whether it is broken)."""
    return header.format == "JPEG" and header.mode in DEVICE_MODES and data.rstrip(b"\0").endswith(b"\xff\xd9")


def rgb_pixels(data: bytes, header: Header) -> np.ndarray:
    """The (h, w, 3) uint8 pixels PIL's `Image.open(data).convert("RGB")` gives (`header`: `data`'s).
    JPEGs of `whole_rgb_jpeg` go through torchvision's decode_jpeg, without PIL's copy out of its own
    memory (0.64 vs 1.09 ms per 256-px JPEG on the H200 host). Both wrap libjpeg-turbo, each its own
    build: their pixels were equal in every test (tests/test_decode.py checks it); a version of either
    that changes the IDCT would show there. libjpeg's warnings on a damaged JPEG it still decodes are
    printed to the worker's stderr by torchvision (PIL is silent). Other images, and JPEGs it refuses, go
    through PIL, which decides what is broken."""
    import numpy as np

    if whole_rgb_jpeg(data, header):
        from torchvision.io import ImageReadMode, decode_jpeg

        try:  # (3, h, w), a view of the decoder's (h, w, 3)
            decoded = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
            assert isinstance(decoded, torch.Tensor)  # one JPEG in, one image out
            return decoded.permute(1, 2, 0).numpy()
        except RuntimeError:
            pass
    image = header.image(data)
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
