import torch
def resized_crops(batch, boxes, size):
    count, height, width = batch.shape[0], batch.shape[2], batch.shape[3]
    across = resample_weights(boxes[:, 1], boxes[:, 3], width, size[1])
    down = resample_weights(boxes[:, 0], boxes[:, 2], height, size[0])
    rows = torch.bmm(batch.float().reshape(count, 3 * height, width), across.transpose(1, 2))
    rows = rows.round_().clamp_(0, 255).view(count, 3, height, size[1])
    return torch.matmul(down.unsqueeze(1), rows).round_().clamp_(0, 255)
def resample_weights(start, length, extent, out):
    start, length = start.float()[:, None, None], length.float()[:, None, None]
    scale = length / out
    centres = start + (torch.arange(out, device=start.device)[None, :, None] + 0.5) * scale
    pixels = torch.arange(extent, device=start.device)[None, None, :] + 0.5
    distance = ((pixels - centres) / scale.clamp(min=1)).abs()
    a = -0.5
    weights = torch.where(distance < 1, ((a + 2) * distance - (a + 3)) * distance * distance + 1,
                          torch.where(distance < 2, (((distance - 5) * distance + 8) * distance - 4) * a, 0.0))
    weights = weights * ((pixels > start) & (pixels < start + length))
    return weights / weights.sum(-1, keepdim=True)
