"""Crops resized on the device as PIL's antialiased bicubic resize does: separable weight matrices, two
batched matrix products whatever the crops' boxes (data.decode "gpu" and "mixed")."""

from __future__ import annotations

import math

import torch


def resized_crops(batch: torch.Tensor, boxes: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """Each uint8 image's box (top, left, height, width) resized to `size` as PIL's bicubic resize of the
    crop does (a horizontal pass rounded to 8 bits, then a vertical one): uint8 (n, 3, *size). `batch`
    (n, 3, H, W), of any strides, may be padded with any values (`transform.padded`, `transform.unpacked`): a
    box lies inside its image, and the weights outside the box are 0. `boxes` are on the host (they size the
    weights' band)."""
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

