"""SDPA's backends at the attention shapes of OpenCLIP's ViT-B-32, -L-14, -H-14, -bigG-14 training steps (bf16,
forward + backward, one process on one GPU): which kernel each backend runs them at, and the text towers' causal
mask given as a tensor (as OpenCLIP adds it) or as is_causal.

    python3 attn_probe.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # name, batch, heads, tokens, head width, text (causal)
    ("B-32 image", 256, 12, 50, 64, False), ("B-32 text", 256, 8, 77, 64, True),
    ("L-14 image", 128, 16, 257, 64, False), ("L-14 text", 128, 12, 77, 64, True),
    ("H-14 image", 64, 16, 257, 80, False), ("H-14 text", 64, 16, 77, 64, True),
    ("bigG image", 32, 16, 257, 104, False), ("bigG text", 32, 20, 77, 64, True)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def timed(fn, repeats=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main():
    torch.manual_seed(0)
    for name, batch, heads, tokens, width, text in SHAPES:
        q, k, v = (torch.randn(batch, heads, tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        grad = torch.randn(batch, heads, tokens, width, device="cuda", dtype=torch.bfloat16)
        mask = torch.full((tokens, tokens), float("-inf"), device="cuda").triu_(1).to(torch.bfloat16)
        # forward FLOPs: two matmuls of tokens x tokens x width per head; backward 2.5x
        flops = 4 * batch * heads * tokens * tokens * width * 3.5
        forms = {"mask tensor": dict(attn_mask=mask), "is_causal": dict(is_causal=True)} if text else {"": {}}
        for form, kwargs in forms.items():
            cells = []
            for backend, kind in BACKENDS.items():
                def step():
                    out = F.scaled_dot_product_attention(q, k, v, **kwargs)
                    out.backward(grad)
                try:
                    with sdpa_kernel([kind]):
                        ms = timed(step)
                    cells.append(f"{backend} {ms:6.3f} ms ({flops / ms / 1e9:4.0f})")
                except RuntimeError:
                    cells.append(f"{backend}    n/a")
            def default():  # the backend torch picks
                F.scaled_dot_product_attention(q, k, v, **kwargs).backward(grad)
            ms = timed(default)
            print(f"{name:11s} {form:11s} default {ms:6.3f} ms | " + " | ".join(cells), flush=True)
    print("(ms per forward + backward; in brackets TFLOP/s, masked tiles counted as done)")


if __name__ == "__main__":
    main()
