"""The patch embedding alone on the GPU: OpenCLIP's Conv2d (cuDNN) beside fsdpclip's DirectPatchEmbedding
(one matmul), bf16, forward + weight gradient (the images need none), at each model's patch size, width and
batch per GPU; and how far their outputs and weight gradients lie apart.

    python patch_probe.py   (run from a tree whose fsdpclip has fsdpclip.direct)
"""
import copy

import torch
from torch import nn

from fsdpclip.direct import use_direct_patch_embedding

CASES = {"ViT-B-32": (32, 768, 256), "ViT-B-32 (512)": (32, 768, 512), "ViT-L-14": (14, 1024, 128),
         "ViT-H-14": (14, 1280, 64), "ViT-bigG-14": (14, 1664, 32)}


def timed(module, images, grad, repeats=30):
    for _ in range(3):
        module(images).backward(grad)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        module(images).backward(grad)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


for name, (patch, width, batch) in CASES.items():
    torch.manual_seed(0)
    conv = nn.Conv2d(3, width, patch, stride=patch, bias=False).cuda().bfloat16()
    direct = copy.deepcopy(conv)
    use_direct_patch_embedding(direct)
    images = torch.randn(batch, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(conv(images))
    outs = []
    for module in (conv, direct):
        module.weight.grad = None
        out = module(images)
        out.backward(grad)
        outs.append((out.float(), module.weight.grad.float()))
    (a, ga), (b, gb) = outs
    conv_ms, direct_ms = timed(conv, images, grad), timed(direct, images, grad)
    print(f"{name:16s} conv {conv_ms:6.3f} ms  direct {direct_ms:6.3f} ms  ({conv_ms / direct_ms:4.1f}x)  "
          f"out differs in {(a != b).float().mean().item():.2e} of values, max {(a - b).abs().max().item():.2e}; "
          f"weight grad max rel {((ga - gb).abs().max() / ga.abs().max()).item():.2e}", flush=True)
