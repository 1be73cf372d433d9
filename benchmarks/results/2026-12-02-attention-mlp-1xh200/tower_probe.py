"""One OpenCLIP block container (DirectAttention as the trainer runs it, bf16 parameters and activations),
compiled as the trainer compiles it (`torch.compile(forward, dynamic=False)`), forward + backward, under one
inductor setting; prints ms per step and the calls the generated code makes outside Triton (extern kernels,
aten ops), counted.

    python3 tower_probe.py B-32 default       # ViT-B-32's image tower (12 blocks, 256 x 50 tokens)
    python3 tower_probe.py L-14 max-autotune  # 4 of ViT-L-14's image blocks (128 x 257 tokens)
"""
import collections
import re
import sys
import time

import torch
from open_clip.transformer import Transformer
from torch._inductor.utils import run_and_get_code

from fsdpclip.direct import use_direct_attention

TOWERS = {"B-32": (768, 12, 12, 256, 50), "L-14": (1024, 4, 16, 128, 257)}  # width, blocks, heads, batch, tokens
MODES = {"default": ({}, None), "coordinate-descent": ({"coordinate_descent_tuning": True}, None),
         "max-autotune": ({}, "max-autotune-no-cudagraphs"),
         "no-split-reductions": ({"split_reductions": False}, None)}


def main(tower: str, mode: str):
    width, blocks, heads, batch, tokens = TOWERS[tower]
    config, compile_mode = MODES[mode]
    torch.manual_seed(0)
    model = Transformer(width, blocks, heads, batch_first=True).cuda().to(torch.bfloat16)
    use_direct_attention(model)
    x = torch.randn(batch, tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, tokens, width, device="cuda", dtype=torch.bfloat16)
    with torch._inductor.config.patch(config):
        forward = torch.compile(model.forward, dynamic=False, mode=compile_mode)

        def step():
            forward(x).backward(grad)
        began = time.perf_counter()
        _, codes = run_and_get_code(step)
        compile_s = time.perf_counter() - began
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            step()
        end.record()
        torch.cuda.synchronize()
    calls = collections.Counter(m.group(0) for code in codes
                                for m in re.finditer(r"(extern_kernels\.\w+|aten\.\w+(\.\w+)?|torch\.ops\.\w+\.\w+)",
                                                     code))
    print(f"{tower} {mode:20s} {start.elapsed_time(end) / 20:8.3f} ms per fwd+bwd of {blocks} blocks "
          f"(first call incl. compile {compile_s:.0f} s); outside Triton: {dict(calls)}", flush=True)
    sums = [line.strip() for code in codes for line in code.splitlines() if "aten.sum" in line or ".sum(" in line]
    for line in sums[:6]:
        print("   ", line[:200])


if __name__ == "__main__":
    main(*sys.argv[1:3])
